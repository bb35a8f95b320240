"""The state dir: one server at a time, a start that refuses a disk it cannot write (one line), a
start-up reconciliation that no entry can stop, a save whose record fails leaving nothing behind,
steps acknowledged to the client surviving ``kill -9``, and damaged sampler checkpoints refused
when a sampling session is created."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _limits import HANG_S
from _server_harness import API_KEY, ServeProcess, ServerThread, free_port, next_token_datum
from skyrl_sdk.server.state.statedir import StateDirError, StateDirLock
from skyrl_sdk.server.state.store import Store


# ---- one server at a time ---------------------------------------------------------------------------
def test_the_lock_is_held_for_the_servers_life_and_names_its_holder(tmp_path):
    with ServerThread(tmp_path / "state") as srv:
        assert srv.runtime is not None
        with pytest.raises(StateDirError, match=rf"state dir {tmp_path / 'state'} is in use by another server "
                                                rf"\(pid {os.getpid()} on .+\); stop it first"):
            Store(tmp_path / "state")
    Store(tmp_path / "state").close()  # released when the server stopped
    lock = StateDirLock.acquire(tmp_path / "state", holder="a test")
    with pytest.raises(StateDirError, match="a test"):
        StateDirLock.acquire(tmp_path / "state")
    lock.release()


# ---- a disk the server cannot write -----------------------------------------------------------------------
@contextlib.contextmanager
def _read_only(directory):
    """``directory`` made unwritable for this process (root ignores modes: the immutable flag)."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(directory)]).returncode != 0:
        pytest.skip("cannot make a directory read-only here (root without chattr +i)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


def _almost_full() -> None:
    """(in the server's process) No file may grow past 16 KiB: writes beyond fail, as on a disk
    with 16 KiB left (Python itself, and the lock file, need less)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))


def _cannot_start(state, preexec_fn=None) -> str:
    """``skyrl-sdk serve`` on ``state``: its exit status must be 2; its output (a pipe: limits on
    file sizes do not apply to it)."""
    proc = subprocess.run([sys.executable, "-m", "skyrl_sdk.cli", "serve", "--lazy", "--port", str(free_port()),
                           "--state-dir", str(state), "--api-key", API_KEY], capture_output=True, text=True,
                          timeout=HANG_S, preexec_fn=preexec_fn, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _refusal(out: str) -> str:
    """The one line of a refused start, after the lines saying what serve was doing (no traceback)."""
    *progress, last = out.strip().splitlines()
    assert all(p.startswith("skyrl-sdk serve: ") and "cannot" not in p for p in progress), out
    return last


@pytest.mark.slow  # a server process
def test_a_read_only_state_dir_is_one_line_at_start(tmp_path):
    """Before: the server started and answered every write with a 500."""
    state = tmp_path / "state"
    state.mkdir()
    with _read_only(state):
        out = _cannot_start(state)
    assert _refusal(out).startswith(f"skyrl-sdk serve: cannot start: state dir {state}")


@pytest.mark.slow  # a server process
def test_a_full_disk_is_one_line_at_start(tmp_path):
    """Before: a raw traceback."""
    out = _cannot_start(tmp_path / "state", preexec_fn=_almost_full)
    assert _refusal(out).startswith(f"skyrl-sdk serve: cannot start: state dir {tmp_path / 'state'}")
    assert "Traceback" not in out


# ---- start-up reconciliation never aborts -----------------------------------------------------------------
def test_no_entry_under_runs_can_stop_a_start(tmp_path, caplog):
    """A 250-character name (its quarantine name used to pass 255 bytes: every start aborted) is
    quarantined under a short hashed name; an entry that cannot move is logged and left."""
    runs = tmp_path / "state" / "runs"
    long = runs / "run-whatever" / "weights" / ("x" * 250)
    long.mkdir(parents=True)
    (long / "model.safetensors").write_bytes(b"junk")
    stuck_folder = runs / "run-stuck" / "sampler_weights"
    (stuck_folder / "stuck").mkdir(parents=True)
    with _read_only(stuck_folder), caplog.at_level(logging.WARNING, logger="skyrl_sdk.server"):
        with ServerThread(tmp_path / "state") as srv:
            assert srv.runtime is not None
    assert not long.exists() and (stuck_folder / "stuck").exists()
    [moved] = list((tmp_path / "state" / "quarantine").iterdir())
    assert moved.name.startswith("x" * 40 + "-") and len(moved.name) < 80 and (moved / "model.safetensors").exists()
    assert "could not reconcile" in caplog.text and "stuck" in caplog.text


# ---- a failed record undoes its save ------------------------------------------------------------------------
def test_a_save_whose_record_fails_leaves_nothing_and_can_be_retried(tmp_path):
    """Before: the directory stayed, the retry said "already exists", and the next start adopted
    the checkpoint the client was told had failed."""
    state = tmp_path / "state"
    with ServerThread(state) as srv:
        service = srv.service_client()
        tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
        store = srv.runtime.store
        real = store.add_checkpoint

        def failing(*args, **kwargs):
            raise sqlite3.OperationalError("database or disk is full")

        store.add_checkpoint = failing
        with pytest.raises(tinker.RequestFailedError, match="database or disk is full"):
            tc.save_state("first").result(timeout=HANG_S)
        with pytest.raises(tinker.RequestFailedError):
            tc.save_weights_for_sampler("exported").result(timeout=HANG_S)
        store.add_checkpoint = real
        assert not any((state / "runs").rglob("first")) and not any((state / "runs").rglob("exported"))
        retried = tc.save_state("first").result(timeout=HANG_S).path  # the name is free
        service.close("success").result()
    with ServerThread(state) as srv:  # nothing to adopt: the failed export is not there
        rest = tinker.RestClient(base_url=srv.url, api_key=API_KEY)
        names = {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    assert names == {retried}


# ---- a delete or an expiry a crash cut short ------------------------------------------------------------------
class _Killed(BaseException):
    """The process died here (kill -9): nothing after it runs."""


def _saved_store(state):
    """A store holding one complete training checkpoint (weights, optimizer, marker) of a run."""
    from skyrl_sdk.models.checkpoint import OPTIMIZER_FILE, atomic_directory
    from skyrl_sdk.server.wire.tinker_paths import TinkerPath

    store = Store(state)
    store.tidy()
    store.add_run("run-a", "alice", None, "tiny", None, None)
    tp = TinkerPath("run-a", "training", "ckpt")

    def write(directory):
        with atomic_directory(directory) as tmp:
            for name in ("model.safetensors", OPTIMIZER_FILE, "skyrl_state.json"):
                (tmp / name).write_bytes(b"x" * 100)

    store.save_recorded(tp, write)
    return store, tp


def _killed_while_removing(monkeypatch):
    """``shutil.rmtree`` removes the optimizer's file, then the process dies (the marker, a dot
    file, is among the last a removal reaches)."""
    from skyrl_sdk.models.checkpoint import OPTIMIZER_FILE

    def partial(path, *args, **kwargs):
        for f in sorted(os.walk(path))[0][2]:
            if f == OPTIMIZER_FILE:
                os.unlink(os.path.join(path, f))
        raise _Killed

    monkeypatch.setattr(shutil, "rmtree", partial)


@pytest.mark.parametrize("how", ["delete", "expiry"])
def test_a_delete_cut_short_by_a_crash_never_brings_the_checkpoint_back(tmp_path, monkeypatch, how):
    """Issue 41, item 8. Before: the record was deleted first and the files removed in place, so
    a kill -9 during the removal left a directory the next start adopted again (``expires_at``
    null), without its optimizer file: loading it with the optimizer failed. Now the directory
    is moved aside in one rename before anything is removed: after the crash and a restart the
    checkpoint is gone, everywhere."""
    import time

    store, tp = _saved_store(tmp_path / "state")
    _killed_while_removing(monkeypatch)
    with pytest.raises(_Killed):
        if how == "delete":
            store.delete_checkpoint(tp)
        else:
            store.update_checkpoint(tp, expires_at=time.time() - 1)
            store.delete_expired()
    monkeypatch.undo()
    store.close()  # (the dead process's lock: released)
    restarted = Store(tmp_path / "state")
    restarted.tidy()
    assert restarted.list_checkpoints("alice")[0] == [] and not restarted.checkpoint_dir(tp).exists()
    assert not (tmp_path / "state" / "quarantine").exists() and not (tmp_path / "state" / "scratch").exists()
    restarted.close()


def test_a_crash_between_the_move_and_the_record_finishes_the_delete_at_start(tmp_path):
    """The other moment a crash can cut a delete: its directory is gone, its record is not. The
    next start deletes the record (the checkpoint is not listed with its files gone)."""
    from _sql_faults import failing

    store, tp = _saved_store(tmp_path / "state")
    with failing(store.root / "server.sqlite3", "DELETE", "checkpoints"):  # dies at the record
        with pytest.raises(sqlite3.IntegrityError, match="injected failure"):
            store.delete_checkpoint(tp)
    assert not store.checkpoint_dir(tp).exists()  # the directory went first
    store.close()
    restarted = Store(tmp_path / "state")
    restarted.tidy()
    assert restarted.list_checkpoints("alice")[0] == [] and not restarted.checkpoint_dir(tp).exists()
    restarted.close()


def test_a_record_whose_files_are_missing_for_another_reason_is_kept(tmp_path):
    """Only a delete's own leftovers finish a delete at start-up: records whose directories are
    missing otherwise (a disk not mounted yet) are kept, not deleted wholesale."""
    store, tp = _saved_store(tmp_path / "state")
    directory = store.checkpoint_dir(tp)
    store.close()
    os.replace(directory, tmp_path / "elsewhere")
    restarted = Store(tmp_path / "state")
    restarted.tidy()
    assert [c["tinker_path"] for c in restarted.list_checkpoints("alice")[0]] == [str(tp)]
    restarted.close()


def test_the_start_empties_scratch_left_by_a_crashed_export(tmp_path):
    """Issue 41, item 9. Before: a crashed export's merged model copy
    (``scratch/exports/<id>/model``) stayed on disk forever: the start cleared only
    ``scratch/offload``."""
    left = tmp_path / "state" / "scratch" / "exports" / "0123abcd" / "model"
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "state" / "scratch" / "snapshots" / "run-x" / "v1").mkdir(parents=True)
    with ServerThread(tmp_path / "state") as srv:
        assert srv.runtime is not None
        assert not (tmp_path / "state" / "scratch" / "exports").exists()
        assert not (tmp_path / "state" / "scratch" / "snapshots").exists()


# ---- a save running at shutdown ------------------------------------------------------------------------------
def test_a_save_running_when_the_server_stops_is_reported_as_what_happened(tmp_path):
    """Issue 41, item 10. Before: at SIGTERM every unfinished request was answered "did not run
    to the end" at once, the running save too, which then committed: after the restart the
    checkpoint the client was told did not run was listed. Now the shutdown waits (up to
    ``shutdown_s``) for the running job, and its long-poll answers with its real result."""
    import threading

    srv = ServerThread(tmp_path / "state").start()
    stopper = threading.Thread(target=srv.stop)
    try:
        service = srv.service_client()
        trainer = service.create_lora_training_client(base_model="tiny", rank=2).result(timeout=HANG_S)
        backend = srv.runtime.models[trainer.model_id].backend
        started, release, real = threading.Event(), threading.Event(), backend.save_state

        def held_save(*args, **kwargs):
            started.set()
            release.wait(HANG_S)
            return real(*args, **kwargs)

        backend.save_state = held_save
        future = trainer.save_state("at-shutdown")
        assert started.wait(HANG_S)
        stopper.start()  # what SIGTERM does (uvicorn's should_exit), with the save running
        while srv.runtime.stopping is None:
            assert stopper.is_alive()
            started.wait(0.01)
        release.set()
        path = future.result(timeout=HANG_S).path  # (before: RequestFailedError "shutting down")
    finally:
        release.set()
        if stopper.ident is None:  # (failed before the stop began)
            srv.stop()
        else:
            stopper.join(HANG_S)
    with ServerThread(tmp_path / "state") as again:
        listed = {c.tinker_path for c in again.rest_client().list_user_checkpoints().result(timeout=HANG_S).checkpoints}
    assert listed == {path}


# ---- acknowledged steps survive kill -9 ------------------------------------------------------------------------
@pytest.mark.slow  # a server process
def test_every_acknowledged_step_is_in_the_history_after_kill_9(tmp_path):
    """Before: written once a second, so a kill -9 right after an acknowledged step lost it."""
    from skyrl_sdk.server.state.history import History

    state = tmp_path / "state"
    with ServeProcess(state, "--api-key", API_KEY) as srv:
        service = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
        tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
        for _ in range(5):
            tc.forward_backward([next_token_datum(5)], "cross_entropy").result(timeout=HANG_S)
            tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=HANG_S)
        srv.proc.kill()
        srv.wait_exit()
    history = History(state / "server.sqlite3", flush_s=3600)
    assert history.summaries([tc.model_id])[tc.model_id]["steps"] == 5
    history.close()


# ---- sampler checkpoints are checked when a sampling session is created -----------------------------------------
@pytest.mark.parametrize("kind", ["sampler", "training"])
def test_a_damaged_checkpoint_is_refused_when_its_sampling_session_is_created(tmp_path, kind):
    """Before: created, then its first sample failed as a server error that did not name it."""
    with ServerThread(tmp_path / "state") as srv:
        service = srv.service_client()
        tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
        save = tc.save_weights_for_sampler if kind == "sampler" else tc.save_state
        path = save("damaged").result().path
        [weights] = list((srv.config.state_dir / "runs").rglob("damaged/model.safetensors"))
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
        with pytest.raises(tinker.BadRequestError) as err:
            service.create_sampling_client(model_path=path).result(timeout=HANG_S)
        assert path in str(err.value) and "model.safetensors is truncated" in str(err.value)
        assert str(srv.config.state_dir) not in str(err.value)
        service.close("success").result()
