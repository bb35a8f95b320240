"""Atomic, pickle-free saves: safetensors for tensors, JSON for metadata.

Everything is written into a temporary directory beside the target, fsynced, then switched
into place. A save only ever replaces a directory that is itself a checkpoint of ours (it
carries :data:`MARKER_FILE`), never the working directory, the home directory, a protected
root or one of their parents. Overwriting exchanges the two directories in one
``renameat2(RENAME_EXCHANGE)`` (Linux), so at every instant the name holds the old or the
new checkpoint. Where the exchange is unavailable, two renames are used and
:func:`clean_interrupted_saves` puts the old checkpoint back if a crash fell between them.
Leftovers of interrupted saves are recognisable by name (``.<name>.skyrl-tmp-<pid>-<id>``,
``.<name>.skyrl-old-<pid>-<id>``; a name too long for that is shortened to a prefix and a hash,
``.<prefix>~<hash>.skyrl-...``, and the marker file records the full one) and removed at the
next save into the same folder. I/O failures become a :class:`~skyrl_sdk.errors.CheckpointError`
naming the target and the cause (:mod:`.io_errors`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from .io_errors import describe, is_symlink_loop, name_max, os_error_of, save_error

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
#: AdamW state of a training checkpoint: ``<param>::exp_avg``, ``::exp_avg_sq``, ``::step``.
OPTIMIZER_FILE = "optimizer.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

#: Written last into every directory a save produces: "this directory is a checkpoint of ours".
MARKER_FILE = ".skyrl_checkpoint"
#: A training-state directory of an earlier version (no marker yet) is ours too.
LEGACY_MARKERS = ("skyrl_state.json",)

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.skyrl-(?P<kind>tmp|old)-(?P<pid>\d+)-(?P<token>[0-9a-f]+)$")
_SHORTENED = re.compile(r"~[0-9a-f]{8}$")  # the end of a shortened leftover's middle part
_ACTIVE: set[Path] = set()  # temporary directories of saves running in this process
_ACTIVE_LOCK = threading.Lock()
_PROTECTED: set[Path] = set()

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


class ExchangeUnsupported(Exception):
    """renameat2 is missing (not Linux, old libc) or unsupported by this file system."""


def protect_directory(root: str | os.PathLike) -> None:
    """Never let a save replace ``root`` or a parent of it (the server protects its state dir)."""
    _PROTECTED.add(Path(root).expanduser().resolve())


def _renameat2(src: Path, dst: Path, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    func = getattr(libc, "renameat2", None)
    if func is None:
        raise ExchangeUnsupported()
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise ExchangeUnsupported()
        raise OSError(code, os.strerror(code), str(src), None, str(dst))


# ---- the steps of a save (separate functions: the crash-injection tests stop at each) -------
def _write_marker(tmp: Path, name: str) -> None:
    """The marker, with the name the checkpoint is saved under (a shortened leftover name is
    mapped back to it by :func:`clean_interrupted_saves`)."""
    (tmp / MARKER_FILE).write_text(json.dumps({"format": "skyrl-sdk checkpoint", "name": name}) + "\n")


def _marker_name(directory: Path) -> str | None:
    try:
        name = json.loads((directory / MARKER_FILE).read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def leftover_name(name: str, kind: str, pid: int, token: str, limit: int) -> str:
    """The name of a save's temporary (``tmp``) or displaced (``old``) directory for target
    ``name``: ``.<name>.skyrl-<kind>-<pid>-<token>``, or, when that is longer than ``limit``
    bytes, ``.<prefix>~<hash>.skyrl-...`` (a valid target name never makes it too long)."""
    suffix = f".skyrl-{kind}-{pid}-{token}"
    full = f".{name}{suffix}"
    if len(os.fsencode(full)) <= limit:
        return full
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:8]
    room = max(0, limit - len(os.fsencode(f".~{digest}{suffix}")))
    prefix = os.fsencode(name)[:room].decode("utf-8", errors="ignore")  # whole characters only
    return f".{prefix}~{digest}{suffix}"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> None:
    """Swap two directories in one step (raises :class:`ExchangeUnsupported` where unsupported)."""
    _renameat2(a, b, _RENAME_EXCHANGE)


def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---- checks ---------------------------------------------------------------------------------
def is_checkpoint_dir(path: Path) -> bool:
    """A real directory (not a link) written by a save of ours."""
    if path.is_symlink() or not path.is_dir():
        return False
    return any((path / m).is_file() and not (path / m).is_symlink() for m in (MARKER_FILE, *LEGACY_MARKERS))


def _unsafe_reason(target: Path, protected: Iterable[str | os.PathLike]) -> str | None:
    roots = [(Path.cwd().resolve(), "the working directory"), (Path.home().resolve(), "the home directory")]
    roots += [(p, "a protected directory") for p in _PROTECTED]
    roots += [(Path(p).expanduser().resolve(), "a protected directory") for p in protected]
    for root, what in roots:
        if target == root:
            return f"it is {what}"
        if target in root.parents:
            return f"it contains {what} ({root})"
    return None


def _target_of(path: str | os.PathLike) -> Path:
    """The absolute target, with its last component unresolved (a link there is not followed)."""
    if not str(path).strip():
        raise CheckpointError("a checkpoint path may not be empty")
    absolute = Path(os.path.abspath(Path(path).expanduser()))
    if not absolute.name:  # the file system root
        return absolute
    try:
        return absolute.parent.resolve() / absolute.name
    except (OSError, RuntimeError) as exc:  # RuntimeError: pathlib's symlink loop (Python < 3.13)
        if isinstance(exc, RuntimeError) and not is_symlink_loop(exc):
            raise
        raise save_error(absolute, exc) from None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def clean_interrupted_saves(root: str | os.PathLike, *, recursive: bool = False) -> list[Path]:
    """Remove the leftovers of interrupted saves in ``root`` (and below, with ``recursive``).

    Only our own names are touched, and only those of processes that are gone (or of this
    process, when no save of it is using them). A checkpoint whose name is missing because a
    save died between its two fallback renames is put back first. Returns what was removed.
    """
    root = Path(root)
    if not root.is_dir() or root.is_symlink():
        return []
    removed: list[Path] = []
    folders = [Path(d) for d, _, _ in os.walk(root)] if recursive else [root]
    for folder in folders:
        try:
            entries = sorted(folder.iterdir())
        except OSError:
            continue
        names = [e.name for e in entries if not _LEFTOVER.match(e.name)]
        for entry in entries:  # sorted: a save's ``old`` comes before its ``tmp`` (read for the name)
            match = _LEFTOVER.match(entry.name)
            if not match or entry.is_symlink() or not entry.is_dir():
                continue
            with _ACTIVE_LOCK:
                if entry in _ACTIVE or (int(match["pid"]) != os.getpid() and _pid_alive(int(match["pid"]))):
                    continue
            if match["kind"] == "old" and is_checkpoint_dir(entry):
                name = _target_name(entry, match, names)
                if name is None or not os.path.lexists(folder / name):
                    if name is not None:  # the fallback switch died halfway: restore the old one
                        with contextlib.suppress(OSError):
                            _rename(entry, folder / name)
                    continue  # never delete the only copy
            _remove_tree(entry)
            removed.append(entry)
    return removed


def _target_name(entry: Path, match: re.Match, names: Iterable[str]) -> str | None:
    """The target name an ``old`` leftover stands for, ``None`` if unknown: its middle part,
    or, when that was shortened, the name in the marker of the same save's new directory (there
    until the switch's second rename), of the old checkpoint itself, or of an entry beside it."""
    pid, token, limit = int(match["pid"]), match["token"], name_max(entry.parent)
    new = entry.with_name(f".{match['name']}.skyrl-tmp-{pid}-{token}")
    for name in (_marker_name(new), _marker_name(entry), *names):
        if name and leftover_name(name, "old", pid, token, limit) == entry.name:
            return name
    shortened = len(os.fsencode(entry.name)) > limit - 4 and _SHORTENED.search(match["name"])
    return None if shortened else match["name"]


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike, *, overwrite: bool = False, protected: Iterable[str | os.PathLike] = ()
) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``path`` only if the block succeeds.

    ``overwrite`` may replace only a checkpoint of ours; ``protected`` roots (and their
    parents) are never replaced, nor the working or home directory.
    """
    target = _target_of(path)
    parent = target.parent
    reason = _unsafe_reason(target, protected)
    if reason is not None:
        raise CheckpointError(f"refusing to save to {target}: {reason}")
    _check_replaceable(target, overwrite)
    blocking = _non_directory_ancestor(parent)
    if blocking is not None:
        raise CheckpointError(f"cannot save to {target}: {blocking}")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot save to {target}: cannot create {parent}: {describe(exc, parent)}") from None
    limit = name_max(parent)
    if len(os.fsencode(target.name)) > limit:
        raise CheckpointError(f"cannot save to {target}: its name is {len(os.fsencode(target.name))} bytes; "
                              f"the limit is {limit} bytes per name")
    clean_interrupted_saves(parent)
    token = secrets.token_hex(4)
    tmp = parent / leftover_name(target.name, "tmp", os.getpid(), token, limit)
    with _ACTIVE_LOCK:
        try:
            os.mkdir(tmp)
        except OSError as exc:
            raise save_error(target, exc, directory=parent) from None
        _ACTIVE.add(tmp)
    try:
        try:
            yield tmp
            _write_marker(tmp, target.name)
            _fsync_tree(tmp)
        except OSError as exc:  # disk full, quota, permissions while writing
            raise save_error(target, exc, directory=tmp, relative_to=tmp) from None
        _switch(tmp, target, overwrite, parent / leftover_name(target.name, "old", os.getpid(), token, limit))
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(tmp)
        if tmp.exists():
            _remove_tree(tmp)


def _non_directory_ancestor(directory: Path) -> str | None:
    """Why ``directory`` cannot be created: its nearest existing ancestor (or itself) is not a directory."""
    for p in (directory, *directory.parents):
        if os.path.lexists(p):
            if p.is_dir():
                return None
            if p.is_symlink():
                return f"{p} is a broken symbolic link, not a directory"
            return f"{p} is a file, not a directory"
    return None


def _check_replaceable(target: Path, overwrite: bool) -> None:
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise CheckpointError(f"{target} already exists (pass overwrite=True to replace it)")
    if target.is_symlink():
        raise CheckpointError(f"refusing to replace {target}: it is a symbolic link")
    if not is_checkpoint_dir(target):
        raise CheckpointError(f"refusing to replace {target}: it is not a checkpoint written by skyrl-sdk")


def _switch(tmp: Path, target: Path, overwrite: bool, old: Path) -> None:
    """Put the finished ``tmp`` at ``target``: at every instant, the old or the new is there."""
    _check_replaceable(target, overwrite)  # again: the block may have run for a long time
    try:
        if os.path.lexists(target):
            try:
                _exchange(tmp, target)  # tmp now holds the old checkpoint
                _fsync_dir(target.parent)
                _remove_tree(tmp)
                return
            except ExchangeUnsupported:
                pass
            _rename(target, old)  # a crash after this: clean_interrupted_saves restores `old`
            _rename(tmp, target)
            _fsync_dir(target.parent)
            _remove_tree(old)
            return
        try:
            _renameat2(tmp, target, _RENAME_NOREPLACE)
        except ExchangeUnsupported:
            _rename(tmp, target)
        _fsync_dir(target.parent)
    except OSError as exc:
        raise save_error(target, exc, directory=target.parent) from None


def dedupe_shared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors that alias an earlier one (tied weights); return (unique, alias->kept)."""
    seen: dict[tuple, str] = {}
    unique, aliases = {}, {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype) \
            if tensor.device.type != "meta" else (name,)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        unique[name] = tensor
    return unique, aliases


def save_tensors(state: dict[str, torch.Tensor], file: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``state`` as one safetensors file; an I/O failure is an ``OSError`` naming ``file``."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    try:
        save_file(tensors, str(file), metadata=metadata)
    except SafetensorError as exc:  # its message carries "(os error N)"; the file it names is its own temp file
        error = os_error_of(exc, file)
        if error is None:
            raise
        raise error from None


def reject_symlinks(directory: Path) -> None:
    """A checkpoint to load is a real directory of real files: a link could point anywhere."""
    directory = Path(directory)
    if directory.is_symlink():
        raise CheckpointError(f"{directory} is a symbolic link; load the directory it points to")
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            if os.path.islink(os.path.join(dirpath, name)):
                raise CheckpointError(f"{os.path.join(dirpath, name)} is a symbolic link; a checkpoint holds "
                                      f"regular files only")


def load_tensors(file: Path) -> dict[str, torch.Tensor]:
    if file.is_symlink():
        raise CheckpointError(f"{file} is a symbolic link; a checkpoint holds regular files only")
    if not file.is_file():
        raise CheckpointError(f"missing checkpoint file {file}")
    try:
        return load_file(str(file))
    except Exception as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from None


def write_hf_weights(
    state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write HF-style safetensors weights, sharded with an index when above ``max_shard_bytes``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_tensors(shards[0], directory / WEIGHTS_FILE, metadata={"format": "pt"})
        return
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_tensors(shard, directory / fname, metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))


def write_json(file: Path, obj: Any) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True))


def read_json(file: Path) -> Any:
    if file.is_symlink():
        raise CheckpointError(f"{file} is a symbolic link; a checkpoint holds regular files only")
    if not file.is_file():
        raise CheckpointError(f"missing checkpoint file {file}")
    try:
        return json.loads(file.read_text())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, absurd nesting
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {describe(exc)}") from None
