"""The runtime: turns a composed run config into a trained, logged, checkpointed run.

The run config: its schema (``config``), composition (``compose``) and validation (``validation``). The
command line (``train_command``): one composition and validation per job, then ``training_run.train``. The
Lightning module, data module, trainer, strategies, loggers, callbacks and checkpoints (``checkpoints``).
It imports the model side (``components``); the model side never imports it.
"""
