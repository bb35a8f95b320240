"""Benchmark 4: forward_backward + optim_step through the official ``tinker`` client against
``skyrl-sdk serve`` (a separate process on loopback) vs the same calls on an in-process
Backend. Both sides train the built-in ``tiny`` model with the same LoRA config and seed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from .common import ADAM, REPO, alternate, check_verdict, make_sft_rows, ratio_summary, summary

NAME = "server_round_trip"
TARGET = 1.15
API_KEY = "tml-bench"
LORA_RANK = 8


def available() -> str | None:
    """None when the server and the client can run, else why not."""
    try:
        import tinker  # noqa: F401

        from skyrl_sdk.server.http.app import create_app  # noqa: F401
    except Exception as exc:  # ImportError, or a half-written module
        return f"not available ({type(exc).__name__}: {exc})"
    return None


def rows_to_tinker(rows) -> list:
    """Benchmark rows (``tokens``, ``targets``, ``weights``) as the tinker client's Datums."""
    from tinker import types as tt

    return [tt.Datum(model_input=tt.ModelInput.from_ints(r["tokens"].tolist()),
                     loss_fn_inputs={"target_tokens": tt.TensorData.from_numpy(r["targets"]),
                                     "weights": tt.TensorData.from_numpy(r["weights"])}) for r in rows]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (a server's compute, whatever else runs)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``skyrl-sdk serve`` in a process of its own (``command``: another module run the same way,
    given ``--port`` and ``--state-dir``), waited for until ``/healthz`` answers."""

    def __init__(self, state_dir: str, threads: int, model: str = "tiny", extra: tuple[str, ...] = (),
                 command: tuple[str, ...] = ("skyrl_sdk.cli", "serve")) -> None:
        self.port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TINKER_TELEMETRY": "0",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", *command, "--model", model, "--port", str(self.port),
               "--state-dir", state_dir, "--api-key", API_KEY, *extra]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.log.read()[-2000:].decode()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not start within 120 s")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run(ctx) -> dict:
    why = available()
    if why is not None:
        return {"status": why, "target": TARGET}
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types as tt

    from skyrl_sdk import Backend, types

    batch, seq = (2, 32) if ctx.smoke else (8, 256)
    rows = make_sft_rows([seq] * batch, 256, seed=5)
    tdata = rows_to_tinker(rows)
    tadam = tt.AdamParams(learning_rate=ADAM["learning_rate"], beta1=ADAM["beta1"], beta2=ADAM["beta2"],
                          eps=ADAM["eps"])
    with tempfile.TemporaryDirectory(prefix="skyrl-bench-server-") as state_dir:
        server = ServerProcess(state_dir, ctx.threads)
        try:
            service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
            client = service.create_lora_training_client(base_model="tiny", rank=LORA_RANK, seed=0)
            client = client.result() if hasattr(client, "result") else client
            local = Backend(model="tiny", lora=types.LoraConfig(rank=LORA_RANK, seed=0), seed=0)
            adam = types.AdamParams(**ADAM)

            def remote_step():
                fb = client.forward_backward(tdata, "cross_entropy")
                opt = client.optim_step(tadam)
                fb.result()
                opt.result()

            def local_step():
                local.forward_backward(tdata, "cross_entropy")
                local.optim_step(adam)

            try:
                times, _ = alternate({"server": remote_step, "in_process": local_step},
                                  reps=ctx.server_reps, warmup=max(1, ctx.warmup))
            finally:
                local.close()
                try:  # finish the session: stops the client's heartbeat thread
                    service.close("success").result(timeout=30)
                except Exception as exc:
                    ctx.log(f"{NAME}: closing the tinker session failed: {exc}")
        finally:
            server.stop()
    ratio = ratio_summary(times["server"], times["in_process"])
    ctx.log(f"{NAME}: ratio {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")
    return {
        "status": "ok",
        "model": "tiny",
        "lora_rank": LORA_RANK,
        "batch": batch,
        "seq_len": seq,
        "server_s": summary(times["server"]),
        "in_process_s": summary(times["in_process"]),
        "overhead_ms": (summary(times["server"])["median"] - summary(times["in_process"])["median"]) * 1e3,
        "ratio": ratio,
        "target": TARGET,
        "verdict": check_verdict(ratio["median"], TARGET),
    }


def table(result: dict) -> list[str]:
    if result.get("status") != "ok":
        return [f"server round trip: {result.get('status')}"]
    r = result["ratio"]
    return [
        "| batch (tiny, LoRA) | server s/step | in-process s/step | overhead ms | ratio median (min-max) | target |",
        "|---|---|---|---|---|---|",
        f"| {result['batch']} x {result['seq_len']} | {result['server_s']['median']:.3f} | "
        f"{result['in_process_s']['median']:.3f} | {result['overhead_ms']:.1f} | "
        f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | <= {result['target']} ({result['verdict']}) |",
    ]
