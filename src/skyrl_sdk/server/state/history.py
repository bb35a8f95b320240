"""Each training run's metrics over its steps, for the console's curves: recorded on the
model's worker thread when a job's result is known, each step written to SQLite before it is
acknowledged to the client (so a ``kill -9`` loses no acknowledged step; a write that fails
is retried by a writer thread of its own), never in a request handler; bounded per run,
downsampled when read.

A **step** is one ``optim_step``: the ``forward_backward`` calls since the previous one are
summed into it (``loss:sum``, ``num_tokens:sum``, and the data's weights, ones where a datum has
none), and its own metrics (``grad_norm``, learning rate, skipped) are added. Its **loss per
token** is ``loss:sum`` over the summed weights: the weighted mean loss per token, which for
``cross_entropy`` is the NLL per token that tinker-cookbook prints as its train NLL (its weights
need not be 0/1: the cookbook's sum to 1 per sequence). Its **seconds** are the wall time from
the end of the previous step (for the first, from the start of its first ``forward_backward``)
to its end: what a step costs the client, waiting and other clients' turns included. Its
entropy and, for an RL step, its RL curves (advantages, sampled tokens, the sampler-trainer
gap, importance ratios) come from :mod:`.step_stats`; a step also keeps the name of its loss.

**Bounded.** A run's steps are stored in buckets of ``stride`` consecutive steps (at first 1:
every step exactly). Each bucket keeps, per series, the count, sum, min and max of its steps'
values. When a run would need more than ``max_rows`` buckets, its stride doubles and
neighbouring buckets merge in pairs, so a run never holds more than ``max_rows`` rows
(2048: about 1 MB at most) however long it trains, and every bucket covers the same number of
steps. Reading merges buckets again into at most ``points`` points (min/max buckets: each
point is the mean, min and max of its steps, so a spike stays visible).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .step_stats import RL_SERIES, STEP_SERIES, call_sums, finite, merge_sums, step_values

logger = logging.getLogger(__name__)

#: the curves, in the console's order
SERIES = ("loss_per_token", "loss_sum", "grad_norm", "learning_rate", "skipped", "tokens", "seconds", *STEP_SERIES,
          *RL_SERIES)
#: a series a bucket written before it existed holds: no values
_EMPTY = (0, 0.0, None, None)
MAX_ROWS = 2048
#: most points one curves answer holds
MAX_POINTS = 2000
#: curves answers kept (encoded) for runs polled again
CURVES_CACHE = 64
_SCHEMA = """
CREATE TABLE IF NOT EXISTS metrics_runs (run_id TEXT PRIMARY KEY, stride INTEGER NOT NULL, steps INTEGER NOT NULL,
                                         last TEXT);
CREATE TABLE IF NOT EXISTS metrics (run_id TEXT NOT NULL, bucket INTEGER NOT NULL, agg TEXT NOT NULL,
                                    PRIMARY KEY (run_id, bucket));
"""


def bucket_of(point: Mapping[str, Any]) -> dict[str, Any]:
    """One step as a bucket: per series ``[count, sum, min, max]`` (count 0 when the value is
    missing, e.g. the ``grad_norm`` of a skipped step)."""
    series = {}
    for name in SERIES:
        v = point.get(name)
        series[name] = [0, 0.0, None, None] if v is None else [1, v, v, v]
    return {"n": 1, "s0": point["step"], "s1": point["step"], "t1": point["time"], "m": series,
            "losses": [point["loss_fn"]] if point.get("loss_fn") else []}


def merge(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Bucket ``a`` followed by bucket ``b``, as one."""
    if a is None:
        return b
    series = {}
    for name in SERIES:
        (ca, sa, lo_a, hi_a), (cb, sb, lo_b, hi_b) = a["m"].get(name, _EMPTY), b["m"].get(name, _EMPTY)
        los = [v for v in (lo_a, lo_b) if v is not None]
        his = [v for v in (hi_a, hi_b) if v is not None]
        series[name] = [ca + cb, sa + sb, min(los) if los else None, max(his) if his else None]
    return {"n": a["n"] + b["n"], "s0": a["s0"], "s1": b["s1"], "t1": b["t1"], "m": series,
            "losses": sorted(set(a.get("losses", ())) | set(b.get("losses", ())))}


def downsample(buckets: list[dict[str, Any]], points: int) -> list[dict[str, Any]]:
    """``buckets`` (in step order) merged in runs of equal length into at most ``points``."""
    k = max(1, math.ceil(len(buckets) / max(1, points)))
    out = []
    for i in range(0, len(buckets), k):
        acc = buckets[i]
        for b in buckets[i + 1:i + k]:
            acc = merge(acc, b)
        out.append(acc)
    return out


def curves_json(run_id: str, steps: int, stride: int, buckets: list[dict[str, Any]]) -> dict[str, Any]:
    """Columns the console draws: per point its step range and, per series, mean / min / max."""
    series = {}
    for name in SERIES:
        cols = [b["m"].get(name, _EMPTY) for b in buckets]
        series[name] = {"mean": [s / c if c else None for c, s, _, _ in cols],
                        "min": [lo for _, _, lo, _ in cols], "max": [hi for _, _, _, hi in cols]}
    return {"run_id": run_id, "steps": steps, "stride": stride, "points": len(buckets),
            "step": [b["s1"] for b in buckets], "step_first": [b["s0"] for b in buckets],
            "n": [b["n"] for b in buckets], "time": [b["t1"] for b in buckets], "series": series,
            "losses": sorted({name for b in buckets for name in b.get("losses", ())})}


class History:
    """Steps recorded by workers, written at each ``optim_step`` (and every ``flush_s`` seconds by
    one writer thread, for what a failed write left pending).

    Two locks: ``_pending_lock`` (workers append; held for microseconds) and ``_db_lock``
    (the writer's transaction, and readers, who take it first and then ``_pending_lock`` so a
    step is always either in the database or still pending, never in neither)."""

    def __init__(self, db_path: Path, flush_s: float = 1.0, max_rows: int = MAX_ROWS,
                 max_pending: int = 100_000, write_through: bool = True) -> None:
        self.flush_s = flush_s
        #: write each step at its optim_step (else only every ``flush_s``: bulk loads in tests)
        self.write_through = write_through
        self.max_rows = max_rows
        self.max_pending = max_pending
        self.dropped = 0
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        # a commit survives the process's death (kill -9) without an fsync per step; a power cut
        # may lose the last steps
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._db_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: list[tuple[str, dict[str, Any]]] = []
        #: run id -> forward_backward sums since its last step, and when its last step ended
        self._open: dict[str, dict[str, Any]] = {}
        self._wake = threading.Event()
        self._closed = False
        #: steps recorded per run by this process (a curves answer is cached per count)
        self._steps_recorded: dict[str, int] = {}
        #: (run id, points, steps recorded) -> the curves answer, JSON
        self._curves_cache: dict[tuple, bytes] = {}
        #: (event loop) curves answers being computed, awaited by every request for the same key
        self._curves_computing: dict[tuple, asyncio.Future] = {}
        #: the one thread that reads curves and summaries for request handlers
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="skyrl-history-reader")
        self._writer = threading.Thread(target=self._loop, name="skyrl-metrics-writer", daemon=True)
        self._writer.start()

    # ---- recording (model worker threads) -------------------------------------------------
    def forward_backward(self, run_id: str, metrics: Mapping[str, Any], started: float, data: Sequence,
                         loss_fn: str | None = None) -> None:
        """A ``forward_backward`` of ``run_id`` on ``data`` (its Datums) with ``loss_fn`` finished;
        ``started``: its ``time.time()`` when it started."""
        sums = call_sums(metrics, data)  # off the lock: it reads the data
        with self._pending_lock:
            acc = self._open.setdefault(run_id, {"since": None})
            if acc.get("since") is None:
                acc["since"] = started
            if loss_fn:
                acc["loss_fn"] = loss_fn
            acc["sums"] = merge_sums(acc.get("sums", {}), sums)

    def optim_step(self, run_id: str, metrics: Mapping[str, Any]) -> None:
        """An ``optim_step`` of ``run_id`` finished: one step, queued for the writer."""
        now = time.time()
        with self._pending_lock:
            acc = self._open.pop(run_id, None) or {"since": None}
            # what the run trains with carries over steps without a forward_backward (an RL batch
            # whose groups all scored alike has nothing to train on)
            kind = {"loss_fn": acc.get("loss_fn"), "rl_run": bool(acc.get("rl_run") or acc.get("sums", {}).get("rl"))}
            self._open[run_id] = {"since": now, **kind}
            step = finite(metrics.get("step"))
            point = {"step": int(step) if step is not None else None, "time": now, **step_values(acc.get("sums", {})),
                     "grad_norm": finite(metrics.get("grad_norm")),
                     "learning_rate": finite(metrics.get("learning_rate")),
                     "skipped": finite(metrics.get("skipped")),
                     "seconds": now - acc["since"] if acc.get("since") is not None else None, **kind}
            if len(self._pending) >= self.max_pending:  # the writer is stuck: keep memory bounded
                self._pending.pop(0)
                self.dropped += 1
            self._pending.append((run_id, point))
            self._steps_recorded[run_id] = self._steps_recorded.get(run_id, 0) + 1
        # written before the step is acknowledged (a kill -9 right after it used to lose the last
        # second of steps); a write that fails leaves them pending for the writer thread
        if self.write_through:
            try:
                self.flush()
            except Exception as exc:
                logger.warning("writing the metrics history failed (kept for the next write): %s", exc)

    # ---- writing (the writer thread) ------------------------------------------------------------
    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # pragma: no cover - a full disk must not end the writer
                logger.exception("writing the metrics history failed")

    def flush(self) -> None:
        """Write every pending step now (one transaction)."""
        with self._db_lock:
            with self._pending_lock:
                batch, self._pending = self._pending, []
            if not batch:
                return
            by_run: dict[str, list[dict[str, Any]]] = {}
            for run_id, point in batch:
                by_run.setdefault(run_id, []).append(point)
            try:
                # IMMEDIATE: take the write lock now, waiting for the store's writes (a deferred
                # transaction that must upgrade from reading fails at once instead of waiting)
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for run_id, points in by_run.items():
                        self._write_run(run_id, points)
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
            except BaseException:  # nothing was written: the steps wait for the next flush
                with self._pending_lock:
                    self._pending[:0] = batch
                raise

    def _meta(self, run_id: str) -> tuple[int, int]:
        row = self._db.execute("SELECT stride, steps FROM metrics_runs WHERE run_id = ?", (run_id,)).fetchone()
        return (row[0], row[1]) if row else (1, 0)

    def _write_run(self, run_id: str, points: list[dict[str, Any]]) -> None:
        stride, steps = self._meta(run_id)
        rows: dict[int, dict[str, Any] | None] = {}
        for point in points:
            bucket = steps // stride
            if bucket not in rows:
                found = self._db.execute("SELECT agg FROM metrics WHERE run_id = ? AND bucket = ?",
                                         (run_id, bucket)).fetchone()
                rows[bucket] = json.loads(found[0]) if found else None
            rows[bucket] = merge(rows[bucket], bucket_of(point))
            steps += 1
        self._db.executemany("INSERT OR REPLACE INTO metrics (run_id, bucket, agg) VALUES (?, ?, ?)",
                             [(run_id, b, json.dumps(agg, separators=(",", ":"))) for b, agg in rows.items()])
        while math.ceil(steps / stride) > self.max_rows:
            stride = self._compact(run_id, stride)
        self._db.execute("INSERT OR REPLACE INTO metrics_runs (run_id, stride, steps, last) VALUES (?, ?, ?, ?)",
                         (run_id, stride, steps, json.dumps(points[-1])))

    def _compact(self, run_id: str, stride: int) -> int:
        """Merge the run's buckets in pairs; returns the doubled stride."""
        merged: dict[int, dict[str, Any]] = {}
        for bucket, agg in self._db.execute("SELECT bucket, agg FROM metrics WHERE run_id = ? ORDER BY bucket",
                                            (run_id,)).fetchall():
            merged[bucket // 2] = merge(merged.get(bucket // 2), json.loads(agg))
        self._db.execute("DELETE FROM metrics WHERE run_id = ?", (run_id,))
        self._db.executemany("INSERT INTO metrics (run_id, bucket, agg) VALUES (?, ?, ?)",
                             [(run_id, b, json.dumps(agg, separators=(",", ":"))) for b, agg in merged.items()])
        return stride * 2

    # ---- reading ---------------------------------------------------------------------------------
    def curves(self, run_id: str, points: int = 1000) -> dict[str, Any]:
        """The run's curves in at most ``points`` points (steps not yet written included)."""
        with self._db_lock:
            stride, steps = self._meta(run_id)
            rows = self._db.execute("SELECT bucket, agg FROM metrics WHERE run_id = ? ORDER BY bucket",
                                    (run_id,)).fetchall()
            with self._pending_lock:
                pending = [p for r, p in self._pending if r == run_id]
        buckets = {b: json.loads(agg) for b, agg in rows}
        for point in pending:
            buckets[steps // stride] = merge(buckets.get(steps // stride), bucket_of(point))
            steps += 1
        merged = downsample([buckets[b] for b in sorted(buckets)], min(max(1, points), MAX_POINTS))
        return curves_json(run_id, steps, stride, merged)

    async def curves_body(self, run_id: str, points: int) -> bytes:
        """:meth:`curves` as JSON bytes, for a request handler: computed and encoded on one reader
        thread (never on the event loop, and never several at once: ten consoles polling a
        100,000-step run used to keep ten threads busy against the loop, and encoding the
        answers on it delayed /healthz by 0.7 s), and computed once per run, ``points`` and
        step count (the same run polled again is a dictionary look-up)."""
        key = (run_id, points, self._steps_recorded.get(run_id, 0))
        if (body := self._curves_cache.get(key)) is not None:
            return body
        if (computing := self._curves_computing.get(key)) is None:  # the first asks; the others wait for it
            computing = asyncio.get_running_loop().run_in_executor(self._reader, self._encode_curves, run_id, points)
            self._curves_computing[key] = computing
            computing.add_done_callback(lambda done: self._computed(key, done))
        return await asyncio.shield(computing)  # a caller that goes away cancels nothing for the others

    def _computed(self, key: tuple, done: asyncio.Future) -> None:
        self._curves_computing.pop(key, None)
        if not done.cancelled() and done.exception() is None:
            self._curves_cache[key] = done.result()
            while len(self._curves_cache) > CURVES_CACHE:
                self._curves_cache.pop(next(iter(self._curves_cache)))

    def _encode_curves(self, run_id: str, points: int) -> bytes:
        return json.dumps(self.curves(run_id, points), separators=(",", ":"), allow_nan=False).encode()

    async def summaries_off_loop(self, run_ids: list[str]) -> dict[str, dict[str, Any]]:
        """:meth:`summaries` on the reader thread."""
        return await asyncio.get_running_loop().run_in_executor(self._reader, self.summaries, run_ids)

    def summaries(self, run_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Run id -> ``{"steps", "last"}`` (its step count and its last step's values)."""
        ids = list(run_ids)
        out: dict[str, dict[str, Any]] = {r: {"steps": 0, "last": None} for r in ids}
        with self._db_lock:
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                marks = ",".join("?" * len(chunk))
                for run_id, steps, last in self._db.execute(
                        f"SELECT run_id, steps, last FROM metrics_runs WHERE run_id IN ({marks})", chunk):
                    out[run_id] = {"steps": steps, "last": json.loads(last) if last else None}
            with self._pending_lock:
                pending = [(r, p) for r, p in self._pending if r in out]
        for run_id, point in pending:
            out[run_id] = {"steps": out[run_id]["steps"] + 1, "last": point}
        return out

    def close(self) -> None:
        """Write what is pending and stop the writer."""
        self._closed = True
        self._reader.shutdown(wait=True)
        self._wake.set()
        self._writer.join(30)
        self.flush()
        self._db.close()
