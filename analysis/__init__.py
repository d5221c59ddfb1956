"""Run analysis tools: ``python -m analysis.<tool> RUN_DIR``.

Tools that run a model on the CPU (evaluate, generate, the harness) start like ``train.py``: the OpenMP
wait policy is chosen from the machine's load before torch loads (``runtime/cpu_wait_policy.py``; a no-op
when torch is already imported).
"""

from runtime.cpu_wait_policy import choose_at_startup

choose_at_startup()
