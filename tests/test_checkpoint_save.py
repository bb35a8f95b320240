"""Saves never destroy what is not a checkpoint of ours, and an overwrite is never lost
(issue 9: data loss and unsafe saves). The crash-injection test stops a forked save at
every step of the switch and checks that the name then loads the old or the new state."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import skyrl_sdk
from _probes import Probes
from skyrl_sdk import errors, types
from skyrl_sdk.models import checkpoint
from skyrl_sdk.testing import make_sft_data

ADAM = types.AdamParams(learning_rate=5e-3)
#: crash points tried / handled (the name then loads old or new), by switch; $SKYRL_PROBE_REPORT
PROBES = Probes("checkpoint saves: crash injection")
_probe_report = PROBES.report_fixture()


@pytest.fixture(scope="module")
def backend():
    with skyrl_sdk.Backend(seed=0) as b:
        yield b


@pytest.fixture
def cwd_with_files(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("precious")
    (work / "sub").mkdir()
    (work / "sub" / "notes.md").write_text("also precious")
    monkeypatch.chdir(work)
    return work


def _tree(root):
    return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else b"") for p in root.rglob("*"))


@pytest.mark.parametrize("path", ["", ".", "./", "sub/.."])
def test_saving_onto_the_working_directory_is_refused(backend, cwd_with_files, path):
    before = _tree(cwd_with_files)
    for save in (backend.save_state, backend.save_weights_for_sampler):
        with pytest.raises(errors.CheckpointError):
            save(path, overwrite=True)
    assert _tree(cwd_with_files) == before


def test_ancestors_of_the_working_directory_home_and_protected_roots_are_refused(
    backend, cwd_with_files, tmp_path, monkeypatch
):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".bashrc").write_text("x")
    before = _tree(tmp_path)
    for target, reason in ((tmp_path, "working directory"), (tmp_path / "home", "home directory"), ("/", "working")):
        with pytest.raises(errors.CheckpointError, match=reason):
            backend.save_state(target, overwrite=True)
    state_root = tmp_path / "state_root"
    with pytest.raises(errors.CheckpointError, match="protected"):
        with checkpoint.atomic_directory(state_root, overwrite=True, protected=[state_root / "ckpts"]):
            pass
    assert _tree(tmp_path) == before
    with checkpoint.atomic_directory(state_root / "ckpts" / "a", protected=[state_root / "ckpts"]) as tmp:
        (tmp / "x").write_text("inside a protected root is fine")
    assert (state_root / "ckpts" / "a" / "x").is_file()


def test_only_a_checkpoint_of_ours_is_replaced(backend, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "results.csv").write_text("1,2")
    with pytest.raises(errors.CheckpointError, match="not a checkpoint written by skyrl-sdk"):
        backend.save_state(data, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(errors.CheckpointError, match="not a checkpoint"):
        backend.save_state(tmp_path / "file", overwrite=True)
    backend.save_state(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(errors.CheckpointError, match="symbolic link"):
        backend.save_state(tmp_path / "link", overwrite=True)
    assert (data / "results.csv").read_text() == "1,2"
    backend.save_state(tmp_path / "real", overwrite=True)  # ours: replaced
    backend.save_weights_for_sampler(tmp_path / "hf")
    backend.save_weights_for_sampler(tmp_path / "hf", overwrite=True)


def test_unwritable_paths_raise_checkpoint_error_with_path_and_reason(backend, tmp_path):
    (tmp_path / "afile").write_text("x")
    for under in ("ckpt", "sub/ckpt"):  # the parent, or an ancestor of it, is a file
        with pytest.raises(errors.CheckpointError, match=r"ckpt: .*afile is a file, not a directory$"):
            backend.save_state(tmp_path / "afile" / under)
    assert (tmp_path / "afile").read_text() == "x"
    with pytest.raises(errors.CheckpointError, match=r"/proc/skyrl-nowhere/ckpt.*cannot"):
        backend.save_state("/proc/skyrl-nowhere/ckpt")


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


NO_SPACE = 'Error while serializing: I/O error: No space left on device (os error 28) at path "{}/.tmpAbC123"'


def test_a_full_disk_is_a_checkpoint_error_naming_the_target_and_the_cause(backend, tmp_path, monkeypatch):
    """safetensors reports ENOSPC as its own SafetensorError (the server answered "internal server
    error"); it becomes a CheckpointError, the old checkpoint stays and nothing is left behind."""
    from safetensors import SafetensorError

    backend.save_state(tmp_path / "ckpt")
    old = _weights(tmp_path / "ckpt")

    def full(tensors, filename, metadata=None):
        raise SafetensorError(NO_SPACE.format(os.path.dirname(filename)))

    monkeypatch.setattr(checkpoint, "save_file", full)
    for save in (backend.save_state, backend.save_weights_for_sampler):
        with pytest.raises(errors.CheckpointError, match=rf"^cannot save to {tmp_path}/ckpt: no space left on the "
                                                         rf"device \(at model\.safetensors\)$"):
            save(tmp_path / "ckpt", overwrite=True)
    assert _names(tmp_path) == ["ckpt"]
    assert all(torch.equal(old[k], v) for k, v in _weights(tmp_path / "ckpt").items())


def test_a_real_write_failure_is_a_checkpoint_error(backend, tmp_path):
    """A real I/O error out of safetensors' writer: a file-size limit (EFBIG), in a forked child."""
    import resource
    import signal

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only the save
        message = "no error"
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
            backend.save_state(tmp_path / "ckpt")
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as fh:
        message = fh.read()
    assert message == f"CheckpointError: cannot save to {tmp_path}/ckpt: File too large (at model.safetensors)"
    assert _names(tmp_path) == []


def test_a_symbolic_link_loop_is_a_checkpoint_error(backend, tmp_path):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(errors.CheckpointError, match=r"cannot save to .*/a/ckpt: a symbolic link loop"):
        backend.save_state(tmp_path / "a" / "ckpt")


@pytest.mark.parametrize("length", [230, 254, 255])
def test_every_valid_name_saves_overwrites_and_loads(backend, tmp_path, length):
    """The temporary names add ~25 bytes to the target's: they are shortened, never the target."""
    target = tmp_path / ("n" * length)
    for overwrite in (False, True):
        backend.save_state(target, overwrite=overwrite)
        backend.save_weights_for_sampler(tmp_path / ("w" * length), overwrite=overwrite)
    backend.load_state(target)
    assert _names(tmp_path) == sorted([target.name, "w" * length])
    for kind in ("tmp", "old"):
        assert len(checkpoint.leftover_name(target.name, kind, 4194304, "0a1b2c3d", 255).encode()) <= 255


def test_a_name_beyond_the_limit_says_the_limit(backend, tmp_path):
    with pytest.raises(errors.CheckpointError, match=r"its name is 256 bytes; the limit is 255 bytes per name"):
        backend.save_state(tmp_path / ("n" * 256))
    assert _names(tmp_path) == []


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_interrupted_saves_are_cleaned_at_the_next_save(backend, tmp_path):
    dead, alive = _dead_pid(), os.getppid()
    ours = [f".s.skyrl-tmp-{dead}-0a1b2c3d", f".s.skyrl-old-{dead}-0a1b2c3d", f".t.skyrl-tmp-{dead}-ff"]
    kept = [f".s.skyrl-tmp-{alive}-0a1b2c3d", ".s.tmp-abc", "skyrl-tmp-1-2", ".notes"]
    for name in ours + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "payload").write_bytes(b"0" * 1000)
    backend.save_state(tmp_path / "s")
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"s", *kept}
    nested = tmp_path / "deep" / "er"
    nested.mkdir(parents=True)
    (nested / f".x.skyrl-old-{dead}-00").mkdir()
    assert checkpoint.clean_interrupted_saves(tmp_path, recursive=True) == [nested / f".x.skyrl-old-{dead}-00"]


# ---- crash injection ------------------------------------------------------------------------
STEPS = ("_write_marker", "_fsync_tree", "_fsync_dir", "_exchange", "_rename", "_remove_tree")


def _weights(directory):
    return load_file(str(directory / "model.safetensors"))


def _which(directory, old, new, loader):
    """'old' or 'new': the state the name loads now (through Backend.load_state)."""
    loader.load_state(directory)
    got = loader.engine.loaded.module.state_dict()
    matches = [n for n, w in (("old", old), ("new", new)) if all(torch.equal(got[k], w[k]) for k in w)]
    assert len(matches) == 1, matches
    return matches[0]


def _overwrite(target, source, monkeypatch, exchange, point):
    """Overwrite ``target`` with ``source`` through ``atomic_directory``, calling ``point()``
    before and after every step of the switch and after every file written: the crash points."""

    def wrap(fn):
        def step(*args, **kwargs):
            point()
            result = fn(*args, **kwargs)
            point()
            return result
        return step

    for name in STEPS:
        monkeypatch.setattr(checkpoint, name, wrap(getattr(checkpoint, name)))
    if not exchange:
        monkeypatch.setattr(checkpoint, "_exchange", _no_exchange)
    with checkpoint.atomic_directory(target, overwrite=True) as tmp:
        for f in sorted(source.iterdir()):
            if f.name == checkpoint.MARKER_FILE:
                continue
            shutil.copy(f, tmp / f.name)
            point()  # mid-write


def _crash_points(target, source, monkeypatch, exchange) -> int:
    """How many crash points an overwrite has (a dry run, here, that does not crash)."""
    calls = [0]
    with monkeypatch.context() as m:
        _overwrite(target, source, m, exchange, lambda: calls.__setitem__(0, calls[0] + 1))
    return calls[0]


def _save_in_child(target, source, crash_at, monkeypatch, exchange):
    """Fork; the child overwrites ``target`` with ``source`` and dies (os._exit) at point ``crash_at``."""
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery, only the save
        try:
            calls = [0]

            def point():
                calls[0] += 1
                if calls[0] == crash_at:
                    os._exit(0)

            _overwrite(target, source, monkeypatch, exchange, point)
            os._exit(1)  # ran to the end without crashing
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _no_exchange(a, b):
    raise checkpoint.ExchangeUnsupported()


#: a valid name so long (254 bytes) that the leftovers' names are shortened (issue 21)
LONG_NAME = "c" * 254


@pytest.mark.parametrize("exchange,name", [(True, "ckpt"), (False, "ckpt"), (False, LONG_NAME)],
                         ids=["renameat2-exchange", "two-renames-fallback", "two-renames-fallback-254-byte-name"])
def test_a_crash_at_any_step_of_an_overwrite_leaves_old_or_new(tmp_path, monkeypatch, exchange, name):
    with skyrl_sdk.Backend(seed=0) as b:
        b.save_state(tmp_path / "old")
        b.forward_backward(make_sft_data([5], seed=0))
        b.optim_step(ADAM)
        b.save_state(tmp_path / "new")
    old, new = _weights(tmp_path / "old"), _weights(tmp_path / "new")
    parent = tmp_path / "saves"
    parent.mkdir()
    target = parent / name
    shutil.copytree(tmp_path / "old", target)
    points = _crash_points(target, tmp_path / "new", monkeypatch, exchange)
    group = f"kill at each step of an overwrite ({'renameat2 exchange' if exchange else 'two-renames fallback'}" \
            f"{', 254-byte name' if name == LONG_NAME else ''})"
    seen = []
    with skyrl_sdk.Backend(seed=3) as loader:
        crash_at = 1
        while True:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(tmp_path / "old", target)
            code = _save_in_child(target, tmp_path / "new", crash_at, monkeypatch, exchange)
            if code == 1:  # no step left to crash at: the save completed
                assert _which(target, old, new, loader) == "new"
                break
            PROBES.tried(group)
            assert code == 0, f"child failed at step {crash_at}"
            if exchange:  # the name is never missing
                seen.append(_which(target, old, new, loader))
            # the next save into this folder (or the server at start) cleans up; the name then
            # holds old or new, and no leftover remains
            checkpoint.clean_interrupted_saves(parent)
            state = _which(target, old, new, loader)
            if not exchange:
                seen.append(state)
            assert sorted(p.name for p in parent.iterdir()) == [name], crash_at
            PROBES.handled(group, state)
            crash_at += 1
    assert crash_at > 10, crash_at  # every step was visited
    assert PROBES.of(group) == (points, points), (group, PROBES.of(group), points)
    assert seen == sorted(seen, key=["old", "new"].index), seen  # old ... old, new ... new
    assert seen[0] == "old" and seen[-1] == "new"
