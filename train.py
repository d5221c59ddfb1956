"""Train a decoder composed from the registries: ``python train.py [hydra overrides]``.

Examples: ``python train.py mixer=mqa ffn.activation=swiglu trainer.max_steps=20``,
``python train.py data=mqar model=tiny``, ``python train.py -m mixer=mha,gqa,mqa``.
The config is composed and validated once, before anything is written (runtime/train_command.py),
then trained by ``runtime.training_run.train``.
"""

from __future__ import annotations

import sys

from runtime.cpu_wait_policy import choose_at_startup

choose_at_startup()  # before torch loads: OpenMP reads its wait policy once, when it loads

from runtime.train_command import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
