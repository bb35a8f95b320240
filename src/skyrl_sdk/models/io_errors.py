"""Checkpoint I/O failures in words: which file, and why (no space, a link loop, a name too long).

Why a module of its own: the causes arrive in three shapes (``OSError`` with an errno,
safetensors' ``SafetensorError`` whose message carries ``(os error N)``, and pathlib's
``RuntimeError("Symlink loop ...")`` before Python 3.13), and saves turn each into one
:class:`~skyrl_sdk.errors.CheckpointError` naming the path and the cause.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from ..errors import CheckpointError

_OS_ERROR = re.compile(r"\(os error (\d+)\)")
#: Linux's usual limits, used when the file system cannot be asked.
DEFAULT_NAME_MAX, DEFAULT_PATH_MAX = 255, 4096


def name_max(directory: Path) -> int:
    """The longest file name (in bytes) the file system of ``directory`` accepts."""
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return DEFAULT_NAME_MAX


def os_error_of(exc: Exception, file: Path) -> OSError | None:
    """safetensors' I/O error as the ``OSError`` it wraps (None when it is not an I/O error)."""
    found = _OS_ERROR.search(str(exc))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(file))


def is_symlink_loop(exc: BaseException) -> bool:
    """pathlib's ``resolve()`` reports a loop as ``RuntimeError`` (before 3.13) or ``ELOOP``."""
    return (isinstance(exc, RuntimeError) and "Symlink loop" in str(exc)) or getattr(exc, "errno", None) == errno.ELOOP


def describe(exc: BaseException, directory: Path | None = None, relative_to: Path | None = None) -> str:
    """The cause of an I/O failure in words, and the file it happened at when known.

    ``directory``: where a too-long name was to be made (its limit is quoted);
    ``relative_to``: a file under it is named relative to it (the temporary directory)."""
    code = errno.ELOOP if is_symlink_loop(exc) else getattr(exc, "errno", None)
    if code == errno.ENOSPC:
        cause = "no space left on the device"
    elif code == errno.EDQUOT:
        cause = "disk quota exceeded"
    elif code == errno.ELOOP:
        cause = "a symbolic link loop (too many levels of symbolic links)"
    elif code == errno.ENAMETOOLONG:
        limit = name_max(directory) if directory is not None and directory.is_dir() else DEFAULT_NAME_MAX
        cause = f"file name too long (the limit is {limit} bytes per name, {DEFAULT_PATH_MAX} per path)"
    elif code:
        cause = os.strerror(code)
    else:
        cause = str(exc) or type(exc).__name__
    file = getattr(exc, "filename", None)
    if file and relative_to is not None and Path(file).is_relative_to(relative_to):
        file = Path(file).relative_to(relative_to).as_posix() or None
    return f"{cause} (at {file})" if file else cause


def save_error(target: Path | str, exc: BaseException, **where: Path | None) -> CheckpointError:
    """``CheckpointError("cannot save to <target>: no space left on the device (at model.safetensors)")``."""
    return CheckpointError(f"cannot save to {target}: {describe(exc, **where)}")
