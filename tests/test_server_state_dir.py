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
