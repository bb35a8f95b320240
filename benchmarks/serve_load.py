"""Load benchmark of ``skyrl-sdk serve`` (a separate process, loopback) through the real tinker client.

- memory: the server's RSS as rank-8 LoRA clients are added one at a time (each runs a few
  ``forward_backward`` + ``optim_step``); growth per extra client over the base's bytes
  (34M Llama; target <= 0.15, as the in-process ``SharedBase`` of ``tenancy``).
- fairness: Alice's big ``forward_backward``; meanwhile Bob (another owner) sends 4-token
  ``forward`` calls one after another. Bob's slowest call against Alice's whole call (what he
  waited when turns were whole jobs), and against Bob's calls on an idle server.
- edge: the worst ``/healthz`` latency (polled every 20 ms) while N connections each send half
  a request line and no key, and while clients post bodies that inflate or parse big (zstd
  bombs to ``forward_backward``, 200 MB each when inflated; JSON bodies just under the 4 MiB
  cap), on a server that asks clients to compress (``benchmarks.serve_load_server``); how many
  stalled connections the header timeout closed; and while 10 consoles poll the curves (2000
  points) and the run list of a 100,000-step run.
- shutdown: seconds from SIGINT to exit while a big call runs and more wait; what they answer.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import tempfile
import threading
import time

from .common import make_model_dir, make_sft_rows, num_parameters, proc_status
from .server import API_KEY, ServerProcess, available, rows_to_tinker
from .tenancy import MODEL_34M, TARGET_MEMORY

NAME = "serve_load"
ALICE, BOB = "tml-bench-alice-0123456789", "tml-bench-bob-0123456789ab"


def _keys_file(directory: str) -> str:
    path = os.path.join(directory, "keys.txt")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(f"{ALICE} alice\n{BOB} bob\n")
    return path


def _datums(vocab: int, rows: int, length: int, seed: int):
    return rows_to_tinker(make_sft_rows([length] * rows, vocab, seed=seed))


def _get(url: str, path: str, key: str = API_KEY) -> dict:
    import urllib.request

    req = urllib.request.Request(url + path, headers={"X-API-Key": key})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _memory(server, model: str, vocab: int, clients: int, steps: int, rows: int, length: int) -> dict:
    import tinker
    from tinker import types as tt

    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    data, adam = _datums(vocab, rows, length, seed=1), tt.AdamParams(learning_rate=1e-4)
    rss, threads, made = [], [], []
    for i in range(clients):
        tc = service.create_lora_training_client(base_model=model, rank=8, seed=i).result(timeout=600)
        for _ in range(steps):
            fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
            fb.result(timeout=600)
            opt.result(timeout=600)
        made.append(tc)
        time.sleep(0.3)
        rss.append(proc_status("VmRSS", server.proc.pid))
        threads.append(_threads(server.proc.pid))
    base_bytes = _get(server.url, "/api/v1/loaded")["bases"][0]["base_bytes"]
    per_client = (rss[-1] - rss[0]) / (clients - 1)
    deltas = [b - a for a, b in zip(rss, rss[1:], strict=False)]
    service.close("success").result(timeout=60)
    return {"clients": clients, "steps_each": steps, "rows": rows, "seq_len": length, "rss": rss,
            "server_threads": threads, "base_bytes": base_bytes, "extra_client_bytes_mean": per_client,
            "extra_client_bytes_median": statistics.median(deltas),
            "ratio": per_client / base_bytes, "target": TARGET_MEMORY,
            "verdict": "met" if per_client / base_bytes <= TARGET_MEMORY else "NOT met",
            "method": "VmRSS of the server process after each client's steps; mean growth over the clients "
                      "after the first (the heap grows in steps of tens of MB when freed activations leave holes "
                      "the adapters' tensors then fill: the median step is the adapter's own share)"}


def _fairness(server, model: str, vocab: int, rows: int, length: int) -> dict:
    import tinker

    clients = {}
    for key in (ALICE, BOB):
        service = tinker.ServiceClient(base_url=server.url, api_key=key)
        clients[key] = (service, service.create_lora_training_client(base_model=model, rank=8).result(timeout=600))
    alice, bob = clients[ALICE][1], clients[BOB][1]
    small, big = _datums(vocab, 1, 4, seed=3), _datums(vocab, rows, length, seed=4)

    def timed_small() -> float:
        t0 = time.perf_counter()
        bob.forward(small, "cross_entropy").result(timeout=600)
        return time.perf_counter() - t0

    idle = [timed_small() for _ in range(5)]
    done = threading.Event()
    t0 = time.perf_counter()
    future = alice.forward_backward(big, "cross_entropy")
    threading.Thread(target=lambda: (future.result(timeout=1800), done.set()), daemon=True).start()
    under = []
    while not done.is_set():
        under.append(timed_small())
    alice_s = time.perf_counter() - t0
    for service, _ in clients.values():
        service.close("success").result(timeout=60)
    worst = max(under)
    return {"big_call": {"rows": rows, "seq_len": length, "seconds": alice_s},
            "small_call_idle_s": statistics.median(idle), "small_calls_during": len(under),
            "small_call_during_median_s": statistics.median(under), "small_call_during_max_s": worst,
            "max_small_over_big_call": worst / alice_s}


class _Poller:
    """GET /healthz every 20 ms on a kept-alive connection; the latencies."""

    def __init__(self, port: int) -> None:
        self.port, self.latencies, self._stop = port, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/api/v1/healthz")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            self.latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(150)
        lat = self.latencies
        return {"polls": len(lat), "median_s": statistics.median(lat), "max_s": max(lat)}


def _connections_probe(port: int, n: int, hold_s: float) -> dict:
    poller = _Poller(port)
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"GET /api/v1/hea")  # half a request line, no key
            socks.append(s)
        except OSError:
            break
    time.sleep(hold_s)
    closed = 0
    for s in socks:
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    return {"connections": len(socks), "held_s": hold_s, "closed_by_server": closed, "healthz": poller.stop()}


def _bodies_probe(port: int, bombs: int, bomb_bytes: int, jsons: int, json_bytes: int) -> dict:
    import zstandard

    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * bomb_bytes)
    doc = json.dumps({"model_id": "m", "adam_params": {}, "pad": [0] * (json_bytes // 3)}).encode()  # "0, " each
    statuses: list = []

    def post(route: str, body: bytes, headers: dict) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            conn.request("POST", route, body, {"X-API-Key": API_KEY, **headers})
            response = conn.getresponse()
            response.read()
            statuses.append((route.rsplit("/", 1)[-1], response.status))
        finally:
            conn.close()

    poller = _Poller(port)
    threads = [threading.Thread(target=post, args=("/api/v1/forward_backward", bomb, {
        "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})) for _ in range(bombs)]
    threads += [threading.Thread(target=post, args=("/api/v1/optim_step", doc, {"Content-Type": "application/json"}))
                for _ in range(jsons)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return {"zstd_bombs": bombs, "bomb_compressed_bytes": len(bomb), "bomb_inflated_bytes": bomb_bytes,
            "json_bodies": jsons, "json_bytes": len(doc), "statuses": sorted(statuses), "healthz": poller.stop()}


#: the run whose long history the console probe polls (its owner: the server's --api-key holder)
CONSOLE_RUN = "sess-bench:train:0"


def _seed_history(state_dir: str, steps: int) -> None:
    """A state dir holding one run of ``steps`` steps of history (before its server starts)."""
    from skyrl_sdk.server.state.history import History
    from skyrl_sdk.server.state.store import Store

    store = Store(state_dir)
    store.add_run(CONSOLE_RUN, "default", "sess-bench", "tiny", None, None)
    history = History(store.root / "server.sqlite3", flush_s=3600, write_through=False)
    for start in range(0, steps, 5000):
        for i in range(start, min(steps, start + 5000)):
            history.optim_step(CONSOLE_RUN, {"step": i + 1.0, "grad_norm": float(i), "learning_rate": 0.1,
                                             "skipped": 0.0})
        history.flush()
    history.close()
    store.close()


def _consoles_probe(port: int, consoles: int, seconds: float) -> dict:
    """``consoles`` threads poll the run list and the long run's curves; /healthz meanwhile."""
    stop, requests = threading.Event(), [0]

    def console() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        while not stop.is_set():
            for path in (f"/console/api/runs/{CONSOLE_RUN}/curves?points=2000", "/console/api/runs"):
                conn.request("GET", path, headers={"X-API-Key": API_KEY})
                conn.getresponse().read()
                requests[0] += 1
        conn.close()

    threads = [threading.Thread(target=console, daemon=True) for _ in range(consoles)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every console polling
    poller = _Poller(port)
    time.sleep(seconds)
    healthz = poller.stop()
    stop.set()
    for t in threads:
        t.join(300)
    return {"consoles": consoles, "seconds": seconds, "requests": requests[0], "healthz": healthz}


def _shutdown(server, model: str, vocab: int, rows: int, length: int) -> dict:
    import tinker

    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=model, rank=8).result(timeout=600)
    big = _datums(vocab, rows, length, seed=5)
    futures = [tc.forward_backward(big, "cross_entropy")] + [tc.forward(big[:1], "cross_entropy") for _ in range(3)]
    answers: list[str] = []

    def wait(f):
        try:
            f.result(timeout=120)
            answers.append("ok")
        except Exception as exc:  # the expected outcome: "the server is shutting down"
            answers.append("shutting down" if "shutting down" in str(exc) else f"{type(exc).__name__}: {exc}"[:120])

    waiters = [threading.Thread(target=wait, args=(f,), daemon=True) for f in futures]
    for w in waiters:
        w.start()
    time.sleep(2.0)
    t0 = time.perf_counter()
    server.proc.send_signal(signal.SIGINT)
    server.proc.wait(120)
    exit_s = time.perf_counter() - t0
    for w in waiters:
        w.join(30)
    return {"exit_after_sigint_s": exit_s, "returncode": server.proc.returncode, "answers": answers}


def run(ctx) -> dict:
    why = available()
    if why is not None:
        return {"status": why}
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the connection probe's sockets
    from .common import MODEL_SMOKE

    spec = MODEL_SMOKE if ctx.smoke else MODEL_34M
    model = str(make_model_dir(ctx.workdir / "model_serve_load", spec))
    vocab = spec["vocab"]
    out: dict = {"model": {**spec, "parameters": num_parameters(spec)}}
    with tempfile.TemporaryDirectory(prefix="skyrl-bench-load-") as tmp:
        keys = _keys_file(tmp)
        big = (8, 256) if ctx.smoke else (24, 512)  # the big call: rows x tokens
        server = ServerProcess(os.path.join(tmp, "state"), ctx.threads or 1, model=model, extra=("--api-keys", keys))
        try:
            clients, steps, rows, length = (3, 1, 2, 32) if ctx.smoke else (8, 2, 8, 256)  # 4.6x before
            out["memory"] = m = _memory(server, model, vocab, clients, steps, rows, length)
            ctx.log(f"{NAME}: extra client {m['extra_client_bytes_mean'] / 2**20:.1f} MiB = {m['ratio']:.3f}x base")
            out["fairness"] = {"micro_batch_tokens_2048_default": _fairness(server, model, vocab, *big)}
            out["shutdown"] = s = _shutdown(server, model, vocab, *big)
            ctx.log(f"{NAME}: exit {s['exit_after_sigint_s']:.1f} s after SIGINT; answers {s['answers']}")
        finally:
            server.stop()
        # a turn is a micro-batch: the same call with the library's 8192-token micro-batches
        small_mb = None if ctx.smoke else ServerProcess(os.path.join(tmp, "state-mb"), ctx.threads or 1, model=model,
                                 extra=("--api-keys", keys, "--engine-config", '{"micro_batch_tokens": 8192}'))
        if small_mb is not None:
            try:
                out["fairness"]["micro_batch_tokens_8192"] = _fairness(small_mb, model, vocab, *big)
            finally:
                small_mb.stop()
        for mb, f in out["fairness"].items():
            ctx.log(f"{NAME}: {mb}: small call under a {f['big_call']['seconds']:.1f} s call: max "
                    f"{f['small_call_during_max_s']:.3f} s (idle {f['small_call_idle_s']:.3f} s)")
        header_timeout = 1.0 if ctx.smoke else 10.0  # 10: the default
        steps = 2_000 if ctx.smoke else 100_000
        _seed_history(os.path.join(tmp, "probe"), steps)
        probe = ServerProcess(os.path.join(tmp, "probe"), ctx.threads or 1, command=("benchmarks.serve_load_server",),
                              extra=("--client-config", json.dumps({"proto_compress_fwdbwd": True}),
                                     "--header-timeout", str(header_timeout)))
        try:
            n, hold = (50, header_timeout + 2) if ctx.smoke else (1500, header_timeout + 2)
            out["connections"] = c = {**_connections_probe(probe.port, n, hold), "header_timeout_s": header_timeout}
            out["bodies"] = b = _bodies_probe(probe.port, *((2, 20 * 2**20, 2, 2**20) if ctx.smoke else
                                                            (6, 200 * 2**20, 6, 4 * 2**20 - 4096)))
            out["consoles"] = k = {**_consoles_probe(probe.port, 10, 2.0 if ctx.smoke else 20.0), "steps": steps}
            ctx.log(f"{NAME}: worst /healthz {c['healthz']['max_s'] * 1e3:.0f} ms under {c['connections']} stalled "
                    f"connections ({c['closed_by_server']} closed), {b['healthz']['max_s'] * 1e3:.0f} ms under bodies, "
                    f"{k['healthz']['max_s'] * 1e3:.0f} ms under {k['consoles']} consoles")
        finally:
            probe.stop()
    return out


def table(result: dict) -> list[str]:
    if "memory" not in result:
        return [f"{NAME}: {result.get('status')}"]
    m, c, b, s = (result[k] for k in ("memory", "connections", "bodies", "shutdown"))
    rows = [
        "| metric | measured | target |",
        "|---|---|---|",
        f"| server RSS per extra rank-8 LoRA client / base bytes ({m['clients']} clients) | {m['ratio']:.3f} "
        f"({m['extra_client_bytes_mean'] / 2**20:.1f} MiB; server threads {m['server_threads'][-1]}) | "
        f"<= {m['target']} ({m['verdict']}) |",
    ]
    for mb, f in result["fairness"].items():
        rows.append(f"| another owner's 4-token forward during a {f['big_call']['rows']} x {f['big_call']['seq_len']} "
                    f"forward_backward ({f['big_call']['seconds']:.1f} s; {mb}) | max {f['small_call_during_max_s']:.3f} "
                    f"s, median {f['small_call_during_median_s']:.3f} s (idle {f['small_call_idle_s']:.3f} s) | "
                    f"one micro-batch |")
    return rows + [
        f"| worst /healthz under {c['connections']} half-sent request lines | {c['healthz']['max_s'] * 1e3:.0f} ms; "
        f"{c['closed_by_server']} closed by the server | < 1 s; closed after the header timeout |",
        f"| worst /healthz under {b['zstd_bombs']} zstd bombs + {b['json_bodies']} JSON bodies | "
        f"{b['healthz']['max_s'] * 1e3:.0f} ms | < 1 s |",
        f"| worst /healthz (median) while {result['consoles']['consoles']} consoles poll the curves of a "
        f"{result['consoles']['steps']}-step run | {result['consoles']['healthz']['max_s'] * 1e3:.0f} ms "
        f"({result['consoles']['healthz']['median_s'] * 1e3:.0f} ms) | < 1 s |",
        f"| SIGINT during a big call with 3 queued | exit after {s['exit_after_sigint_s']:.1f} s; {s['answers']} | "
        f"~10 s |",
    ]
