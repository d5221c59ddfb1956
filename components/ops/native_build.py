"""Builds the project's native CPU kernels (``components/ops/*_cpu.cpp``) on first use, once per machine.

Each kernel is one C++ source registering its ops under its own ``torch.ops`` namespace. It is compiled with
the C++ compiler TorchInductor uses, into PyTorch's extension cache, and loaded into the process; where it
cannot be built (no compiler, headers or BLAS symbols) the caller's PyTorch form runs instead and a warning
says why, once. An environment switch per kernel (``<NAME>=0``) turns it off for comparisons and debugging.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_built: dict[str, bool] = {}


def build_cpu_extension(source: Path, env_switch: str, on_load: Optional[Callable[[], None]] = None) -> bool:
    """Whether the kernel in ``source`` (its ops namespace is the file's stem) is loaded: built and loaded on
    the first call, the answer cached after it. ``on_load`` runs once, right after a successful load (the
    Python-side registrations of its ops: fake tensors, autograd)."""
    name = source.stem
    if name in _built:
        return _built[name]
    with _lock:
        if name not in _built:
            _built[name] = os.environ.get(env_switch, "1") != "0" and _load(name, source)
            if _built[name] and on_load is not None:
                on_load()
    return _built[name]


def _load(name: str, source: Path) -> bool:
    try:
        from torch.utils.cpp_extension import load  # start-up time: setuptools, only when a kernel builds

        # the ninja the project installs sits beside this interpreter, on PATH or not
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        load(
            name=f"k3_{name}",
            sources=[str(source)],
            # -fopenmp: at::parallel_for is an OpenMP loop compiled into the kernel (serial without it)
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            # -lmvec: glibc's vector math (exp), which -ffast-math vectorised loops call
            extra_ldflags=["-fopenmp", "-lmvec"],
            is_python_module=False,
            verbose=False,
        )
        return True
    except Exception as err:
        _log.warning("the native CPU kernel %s could not be built (%s); using its PyTorch form", source.name, err)
        return False
