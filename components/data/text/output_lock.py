"""One preparation of an output folder at a time, across processes (parallel runs, data-parallel ranks).

An exclusive ``flock`` on a hidden sibling ``.<name>.lock``: a second preparation of the same folder waits
for the first, then finds the folder it wrote (reused when the inputs match, refused when they do not),
so two runs can neither collide at the final rename nor replace each other's folder. The holder removes
the lock file when done, so nothing is left beside the folder; a waiter that wakes holding a removed file
opens the path again. The kernel drops the lock when its holder exits, killed or not (a killed holder
leaves the file, which the next preparation takes over).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Callable, Optional


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


class OutputLock:
    def __init__(self, out: Path, log: Callable[[str], None] = lambda msg: None):
        self.out = Path(out)
        self.log = log
        self._fd: Optional[int] = None

    def __enter__(self) -> "OutputLock":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        path = lock_path(self.out)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.log(f"{self.out}: another preparation of this folder is running; waiting for it")
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                held, now = os.fstat(fd), os.stat(path)
                # still the file at the path: the lock is ours
                if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                    self._fd = fd
                    return self
            except FileNotFoundError:
                pass  # the previous holder removed it after we opened it
            os.close(fd)

    def __exit__(self, *exc) -> None:
        assert self._fd is not None
        os.unlink(lock_path(self.out))  # while still held: a waiter sees the file is gone and reopens
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
