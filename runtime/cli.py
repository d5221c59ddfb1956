"""What every command-line tool (``prepare.py``, ``analysis.*``) shares: argument types that refuse a bad
value by naming the option (argparse then prints ``PROG: error: argument --X: ...`` and exits 2), and
one way to report an expected failure: ``PROG: error: MESSAGE`` on one line, exit 2, no traceback.

Each tool checks every argument before it starts work, so a refused command has written nothing.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from typing import Callable, Optional


def finite_float(minimum: Optional[float] = None, maximum: Optional[float] = None, above: bool = False):
    """An argparse type: a finite float, at least ``minimum`` (above it if ``above``), at most ``maximum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if minimum is not None and (value <= minimum if above else value < minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {minimum:g}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:g}, got {text}")
        return value

    return parse


def int_at_least(minimum: int):
    """An argparse type: a whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def utf8_text(text: str) -> str:
    """An argparse type: text that is valid UTF-8 (argv bytes that are not arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not valid UTF-8 text") from None
    return text


def torch_device(text: str) -> str:
    """An argparse type: a device torch knows and this machine has (cpu, cuda, cuda:N, mps)."""
    import torch  # start-up time: the tools' --help and argument errors never load torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise argparse.ArgumentTypeError(f"'{text}': this machine has no CUDA device; use cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"'{text}': this machine has {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"'{text}': MPS is not available here; use cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"'{text}': use cpu, cuda or cuda:N")
    return text


def new_output_path(text: str) -> str:
    """An argparse type: a path a tool may create (nothing on the way to it is a regular file)."""
    path = os.path.abspath(text)
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"'{text}': {parent} is a file, not a folder")
    return text


class ToolError(ValueError):
    """An expected failure of a tool, reported as one line; ``status`` is its exit status."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def reports_errors(prog: str, *expected: type[BaseException]) -> Callable:
    """Decorate a tool's ``main``: ToolError and the ``expected`` error types become ``PROG: error: MESSAGE``
    on stderr and exit status 2 (ToolError's own status), with no traceback."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except ToolError as err:
                print(f"{prog}: error: {err}", file=sys.stderr)
                return err.status
            except expected as err:
                print(f"{prog}: error: {err}", file=sys.stderr)
                return 2

        return run

    return wrap
