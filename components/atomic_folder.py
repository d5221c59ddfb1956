"""A folder written under a hidden name beside its final one and put in place only when complete.

A writer stages ``OUT`` as ``.OUT.tmp-<pid>`` in the same parent folder and puts it in place with one
rename, so a writer killed at any point leaves ``OUT`` as it was: the previous folder byte-identical,
or nothing. A folder that replaces another is exchanged with it in one step (Linux ``renameat2`` with
``RENAME_EXCHANGE``): there is never a moment without one complete folder at ``OUT``. Where the file
system cannot exchange, the previous folder is set aside as ``.OUT.old-<pid>`` for the moment between
two renames, and put back by ``clear_stale`` if its writer died there.

What a killed writer leaves beside ``OUT`` (its hidden staging folder) is removed by the next writer's
``clear_stale``; the folders of writers still running are left alone.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

STAGING, SET_ASIDE = "tmp", "old"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging_path(out: Path, kind: str = STAGING) -> Path:
    """This process's hidden sibling of ``out`` (``.OUT.tmp-<pid>``)."""
    return out.parent / f".{out.name}.{kind}-{os.getpid()}"


def siblings(out: Path) -> list[Path]:
    """Every hidden sibling of ``out`` (staging folders, set-aside folders, a lock file)."""
    return sorted(out.parent.glob(f".{out.name}.*"))


def _stale(out: Path) -> Iterator[tuple[str, Path]]:
    """(kind, path) of the staging and set-aside folders beside ``out`` whose writer is no longer running."""
    for p in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = p.name[len(out.name) + 2 :].rpartition("-")
        if kind not in (STAGING, SET_ASIDE) or not (pid.isascii() and pid.isdigit()):
            continue
        if int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            yield kind, p


def clear_stale(out: Path) -> None:
    """Remove what killed writers left beside ``out``; a previous folder a killed writer had set aside
    goes back to ``out`` when nothing took its place."""
    for kind, p in sorted(_stale(out), key=lambda item: item[0] != SET_ASIDE):
        if kind == SET_ASIDE and not out.exists():
            os.replace(p, out)
        elif p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step; False where this system or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library older than glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def put_in_place(staged: Path, out: Path, replace: bool = False) -> None:
    """Make the complete folder ``staged`` be ``out``: one rename onto nothing or an empty folder, or,
    with ``replace``, one exchange with the previous folder (then removed). OSError when ``out`` is a
    file, or a folder with something in it and not ``replace`` (another writer filled it meanwhile)."""
    sys.audit("atomic_folder.put_in_place", str(staged), str(out))  # one step, as os.rename's event
    if not (replace and out.is_dir() and not out.is_symlink() and any(out.iterdir())):
        os.replace(staged, out)  # refused by the system for a file, or a folder that is not empty
        return
    if _exchange(staged, out):  # ``staged`` now holds the previous folder
        shutil.rmtree(staged, ignore_errors=True)
        return
    old = staging_path(out, SET_ASIDE)
    os.replace(out, old)
    os.replace(staged, out)
    shutil.rmtree(old, ignore_errors=True)
