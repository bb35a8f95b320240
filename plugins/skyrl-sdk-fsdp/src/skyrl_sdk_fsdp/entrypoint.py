"""Process entry points of the ranks (what a rank process runs from start to exit).

- :func:`spawned_main`: a rank process started by the controller (``launcher="spawn"``).
  It joins a private process group through the controller's TCP store, then serves
  requests read from a socket inherited from the controller until told to stop. It exits
  on its own when the controller goes away (socket closed or parent pid changed).
- :func:`worker_main`: ranks 1..N-1 of a ``torchrun`` job. Requests come from rank 0 (the
  controller, which runs the user's script) over a gloo control group; the loop ends when
  rank 0's interpreter exits, and then this process exits too (``SystemExit(0)``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from .options import ENV_PREFIX  # this module imports no torch at the top


def _watch_parent(parent_pid: int, interval: float = 0.5) -> None:
    """Exit hard when the controller process is gone (we were re-parented)."""

    def loop() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(17)
            time.sleep(interval)

    threading.Thread(target=loop, name="skyrl-fsdp-parent-watch", daemon=True).start()


def spawned_main() -> None:
    """Entry point of a spawned rank (see module docstring). Never returns."""
    env = os.environ
    rank = int(env[ENV_PREFIX + "RANK"])
    world_size = int(env[ENV_PREFIX + "WORLD_SIZE"])
    parent_pid = int(env[ENV_PREFIX + "PARENT_PID"])
    _watch_parent(parent_pid)
    # Ctrl-C goes to the whole foreground process group: the controller handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from multiprocessing.connection import Connection

    conn = Connection(int(env[ENV_PREFIX + "FD"]))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(env.get(ENV_PREFIX + "THREADS", "1")))
    try:  # ranks share the controller's terminal: no per-rank progress bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass
    from .dispatch import Dispatcher, describe_error
    from .session import init_session

    code = 0
    try:
        timeout_s = float(env[ENV_PREFIX + "TIMEOUT_S"])
        try:
            store = dist.TCPStore(
                env[ENV_PREFIX + "STORE_HOST"], int(env[ENV_PREFIX + "STORE_PORT"]), is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            session = init_session(
                rank=rank, world_size=world_size, local_rank=rank, device_type=env[ENV_PREFIX + "DEVICE"],
                timeout_s=timeout_s, store=store,
            )
        except Exception as exc:  # report the failure to the first request, then stop
            conn.recv()
            conn.send(("error", describe_error(exc, rank, clean=True)))
            code = 1
            return
        dispatcher = Dispatcher(session)
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # controller gone
            op, payload = message
            if op == "shutdown":
                break
            conn.send(dispatcher.handle(0, op, payload))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: peers may already be gone


# ---- torchrun -----------------------------------------------------------------------------
def worker_main() -> None:
    """Serve rank 0 on ranks != 0 of a torchrun job, then exit; return at once elsewhere.

    Put it at the top of a script started with ``torchrun --nproc-per-node N script.py``
    (``Backend(engine="fsdp")`` calls it too, so scripts without it work as well: ranks
    != 0 then serve from inside that call). Rank 0 runs the rest of the script as the
    controller; it drives the other ranks until its interpreter exits.
    """
    from .options import launcher_env

    env = launcher_env()
    if env is None or env.rank == 0:
        return
    import torch.distributed as dist

    from . import control
    from .dispatch import TorchrunJob

    job = TorchrunJob.get()
    group = job.session.control_group
    while True:
        engine_id, op, payload = control.receive(group)
        if op == "exit":
            break
        reply = job.dispatcher.handle(engine_id, op, payload)
        dist.gather_object(reply, None, dst=0, group=group)
    # Leave without tearing down the process group or the interpreter: rank 0 is exiting at
    # the same moment, and gloo's teardown racing it aborted this rank now and then
    # ("terminate called without an active exception", SIGABRT), failing the whole job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
