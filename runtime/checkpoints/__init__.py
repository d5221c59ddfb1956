"""A run's checkpoints: where they live, how they are written and read, which one a run resumes or
branches from.

* ``layout``: ``<run>/checkpoints/last.ckpt`` and ``step=N.ckpt`` (files, or FSDP2 sharded folders), the
  keys a checkpoint holds, and the newest readable checkpoint of a run folder (resume, ``load_run``);
* ``write``: atomic writes (a crash or a full disk never leaves a half-written file under a checkpoint's name);
* ``read``: verified reads (a truncated or corrupt checkpoint is refused by name);
* ``branching``: ``init_from`` / ``init_step``, a new run started from another run's checkpoint or weights.

Only ``write`` imports Lightning: the analysis tools read checkpoints without it.
"""
