"""The console's data: the metrics history (steps, bounding, downsampling: checked against
numpy over the raw values) and the JSON endpoints the page reads, through a real server and
the unmodified tinker client (values equal what the client itself got back; owners see only
their own; the server view is for operators). The page in a browser:
tests/test_server_console_browser.py."""

from __future__ import annotations

import math
import sqlite3
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _server_harness import API_KEY, ServerThread, raw_client
from skyrl_sdk import types
from skyrl_sdk.errors import InputError
from skyrl_sdk.server.config import DEFAULT_OWNER, ServerConfig, read_api_keys
from skyrl_sdk.server.state.history import SERIES, History

ALICE, BOB, OPS = "tml-alice", "tml-bob", "tml-ops"


# ---- the history ----------------------------------------------------------------------------------
def _data(*weights: list[float]) -> list[types.Datum]:
    return [types.Datum(model_input=types.ModelInput.from_ints(list(range(1, len(w) + 1))),
                        loss_fn_inputs={"target_tokens": list(range(2, len(w) + 2)), "weights": w}) for w in weights]


def _record(h: History, run: str, values, first_step: int = 1) -> None:
    """One step per value: a forward_backward with loss:sum = value (on 2 tokens of weights
    0.75 + 0.25), then an optim_step with grad_norm = |value|."""
    for i, v in enumerate(values, first_step):
        h.forward_backward(run, {"loss:sum": float(v), "num_tokens:sum": 2.0}, time.time(), _data([0.75, 0.25]))
        h.optim_step(run, {"step": float(i), "grad_norm": abs(float(v)), "learning_rate": 0.1, "skipped": 0.0})


def _rows(db, run: str) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT COUNT(*) FROM metrics WHERE run_id = ?", (run,)).fetchone()[0]


def test_a_step_sums_the_forward_backward_calls_since_the_last_one(tmp_path):
    h = History(tmp_path / "db", flush_s=3600, write_through=False)
    t0 = time.time() - 100.0
    h.forward_backward("r", {"loss:sum": 6.0, "num_tokens:sum": 10.0}, t0, _data([1.0, 0.5, 0.0], [2.5]))
    h.forward_backward("r", {"loss:sum": 3.0, "num_tokens:sum": 5.0}, t0 + 1, _data([0.0, 2.0]))
    h.optim_step("r", {"grad_norm": 2.5, "learning_rate": 1e-3, "skipped": 0.0, "step": 1.0})
    h.optim_step("r", {"grad_norm": math.nan, "learning_rate": 1e-3, "skipped": 1.0, "step": 2.0})  # no fb, skipped
    pending = h.curves("r")
    h.flush()
    stored = h.curves("r")
    assert pending == stored  # not yet written or written: the same answer
    s = stored["series"]
    assert stored["steps"] == 2 and stored["step"] == [1, 2] and stored["n"] == [1, 1]
    assert s["loss_per_token"]["mean"] == [9.0 / 6.0, None] and s["loss_sum"]["mean"] == [9.0, None]  # / weights
    assert s["tokens"]["mean"] == [15.0, None] and s["grad_norm"]["mean"] == [2.5, None]
    assert s["skipped"]["mean"] == [0.0, 1.0] and s["learning_rate"]["mean"] == [1e-3, 1e-3]
    assert s["seconds"]["mean"][0] >= 100.0 and 0.0 <= s["seconds"]["mean"][1] < 100.0
    assert h.summaries(["r", "other"]) == {"r": {"steps": 2, "last": h.summaries(["r"])["r"]["last"]},
                                           "other": {"steps": 0, "last": None}}
    assert h.summaries(["r"])["r"]["last"]["skipped"] == 1.0
    h.close()


def test_a_steps_throughput_is_its_calls_tokens_over_their_compute_time(tmp_path):
    h = History(tmp_path / "db", flush_s=3600, write_through=False)
    t0 = time.time() - 100.0
    h.forward_backward("r", {"loss:sum": 6.0, "num_tokens:sum": 10.0, "seconds:sum": 2.0, "mfu:mean": 0.3},
                       t0, _data([1.0], [1.0]))
    h.forward_backward("r", {"loss:sum": 3.0, "num_tokens:sum": 30.0, "seconds:sum": 6.0, "mfu:mean": 0.5},
                       t0 + 1, _data([1.0]))
    h.optim_step("r", {"grad_norm": 1.0, "learning_rate": 1e-3, "skipped": 0.0, "step": 1.0})
    h.forward_backward("r", {"loss:sum": 1.0, "num_tokens:sum": 4.0, "seconds:sum": 1.0}, t0 + 2, _data([1.0]))
    h.optim_step("r", {"grad_norm": 1.0, "learning_rate": 1e-3, "skipped": 0.0, "step": 2.0})  # no peak known
    s = h.curves("r")["series"]
    assert s["tokens_per_second"]["mean"] == [40.0 / 8.0, 4.0]
    assert s["mfu"]["mean"] == [pytest.approx((0.3 * 2.0 + 0.5 * 6.0) / 8.0), None]
    h.close()


def test_a_run_is_bounded_and_its_buckets_equal_numpy_over_the_raw_steps(tmp_path):
    values = np.random.default_rng(0).normal(size=100)
    h = History(tmp_path / "db", flush_s=3600, max_rows=8)
    for start in range(0, 100, 7):  # written in uneven batches, compacting on the way
        _record(h, "r", values[start:start + 7], first_step=start + 1)
        h.flush()
    assert _rows(tmp_path / "db", "r") <= 8
    for points, width in ((1000, 16), (3, 48)):  # stride 16: 7 stored buckets; 3 points of 3 buckets each
        c = h.curves("r", points=points)
        assert c["stride"] == 16 and c["steps"] == 100 and c["points"] == math.ceil(100 / width)
        for j in range(c["points"]):
            chunk = values[j * width:(j + 1) * width]
            assert (c["step_first"][j], c["step"][j], c["n"][j]) == (j * width + 1, j * width + len(chunk), len(chunk))
            lpt = c["series"]["loss_per_token"]
            assert lpt["mean"][j] == pytest.approx(chunk.mean(), rel=1e-12, abs=1e-15)
            assert (lpt["min"][j], lpt["max"][j]) == (chunk.min(), chunk.max())
            assert c["series"]["grad_norm"]["max"][j] == np.abs(chunk).max()
            assert c["series"]["tokens"]["mean"][j] == 2.0
    h.close()


def test_how_steps_are_batched_into_writes_changes_nothing(tmp_path):
    values = np.random.default_rng(1).normal(size=40)
    every = History(tmp_path / "a", flush_s=3600, max_rows=4)
    once = History(tmp_path / "b", flush_s=3600, max_rows=4, write_through=False)
    for i, v in enumerate(values, 1):
        _record(every, "r", [v], first_step=i)
        every.flush()
    _record(once, "r", values)
    once.flush()
    a, b = every.curves("r"), once.curves("r")
    assert a["stride"] == b["stride"] == 16 and (a["n"], a["step"]) == (b["n"], b["step"])
    for name in set(SERIES) - {"seconds", "tokens_per_second", "mfu"}:  # (wall time differs; none recorded)
        for stat in ("mean", "min", "max"):
            x, y = a["series"][name][stat], b["series"][name][stat]
            assert [v is None for v in x] == [v is None for v in y], (name, stat)
            assert [v for v in x if v is not None] == pytest.approx([v for v in y if v is not None], rel=1e-12)
    every.close()
    once.close()


def test_the_history_survives_a_restart(tmp_path):
    h = History(tmp_path / "db", flush_s=3600)
    _record(h, "r", [3.0, 2.0, 1.0])
    before = h.curves("r")
    h.close()  # writes what is pending
    again = History(tmp_path / "db", flush_s=3600)
    assert again.curves("r") == before and again.summaries(["r"])["r"]["steps"] == 3
    again.close()


#: steps written while the store writes too (with a plain deferred BEGIN, SQLite refused a write in
#: 6 of 7 runs of this test)
STEPS_UNDER_LOAD = 100


def test_writes_wait_for_the_stores_writes_and_a_failed_write_loses_nothing(tmp_path):
    import threading

    from skyrl_sdk.server.state.store import Store

    store = Store(tmp_path)
    h = History(store.root / "server.sqlite3", flush_s=3600)
    stop = threading.Event()

    def hammer():  # the store's own writes, on another connection to the same file
        n = 0
        while not stop.is_set():
            store.add_session(f"s-{n}", "alice", None, None, None)
            n += 1

    writer = threading.Thread(target=hammer)
    writer.start()
    try:
        for i in range(STEPS_UNDER_LOAD):
            _record(h, "r", [float(i)], first_step=i + 1)
            h.flush()  # raises if SQLite refused the write
    finally:
        stop.set()
        writer.join()
    assert h.curves("r")["steps"] == STEPS_UNDER_LOAD

    from _sql_faults import failing

    with failing(store.root / "server.sqlite3", "INSERT", "metrics"):
        _record(h, "r", [5.0, 6.0], first_step=STEPS_UNDER_LOAD + 1)
        with pytest.raises(sqlite3.IntegrityError, match="injected failure"):
            h.flush()
    assert h.curves("r")["steps"] == STEPS_UNDER_LOAD + 2  # still pending
    assert _rows(store.root / "server.sqlite3", "r") == STEPS_UNDER_LOAD  # nothing of it written
    h.flush()
    assert _rows(store.root / "server.sqlite3", "r") == STEPS_UNDER_LOAD + 2
    assert h.curves("r")["series"]["loss_sum"]["mean"][-2:] == [5.0, 6.0]
    h.close()
    store.close()


@pytest.mark.slow
def test_100k_steps_stay_within_the_bounds(tmp_path):
    h = History(tmp_path / "db", flush_s=3600, write_through=False)  # written 5000 steps at a time
    for start in range(0, 100_000, 5_000):
        for i in range(start, start + 5_000):
            h.optim_step("r", {"step": i + 1.0, "grad_norm": float(i), "learning_rate": 0.1, "skipped": 0.0})
        h.flush()
    assert _rows(tmp_path / "db", "r") == 1563  # ceil(100000 / 64): the width doubled 6 times
    c = h.curves("r", points=1000)
    assert c["stride"] == 64 and c["steps"] == 100_000 and c["points"] <= 1000 and sum(c["n"]) == 100_000
    assert (c["step_first"][0], c["step"][-1]) == (1, 100_000)
    assert c["series"]["grad_norm"]["min"][0] == 0.0 and c["series"]["grad_norm"]["max"][-1] == 99_999.0
    h.close()


# ---- who is an operator -----------------------------------------------------------------------------
def test_operators_are_marked_in_the_keys_file_or_hold_the_api_key(tmp_path):
    f = tmp_path / "keys"
    f.write_text("tml-a alice operator\ntml-b bob\ntml-c carol  # operator\n")
    operators: set[str] = set()
    assert read_api_keys(f, operators) == {"tml-a": "alice", "tml-b": "bob", "tml-c": "carol"}
    assert operators == {"alice"}
    both = ServerConfig(api_keys=read_api_keys(f), operators=operators, api_key="tml-k")
    assert [both.is_operator(o) for o in ("alice", "bob", "carol", DEFAULT_OWNER)] == [True, False, False, True]
    file_only = ServerConfig(api_keys=read_api_keys(f), operators=operators)
    assert not file_only.is_operator(DEFAULT_OWNER) and file_only.is_operator("alice")
    assert ServerConfig().is_operator(DEFAULT_OWNER)  # no key at all: the one owner runs the server
    f.write_text("tml-a alice admin\n")
    with pytest.raises(InputError, match=r"line 1: expected 'KEY \[OWNER \[operator\]\]', got 3 fields"):
        read_api_keys(f)


# ---- the endpoints ---------------------------------------------------------------------------------
#: weights of the two data of every step: not 0/1 (tinker-cookbook's sum to 1 per sequence)
WEIGHTS = ([0.0] * 3 + [0.125] * 8, [0.5] * 6 + [0.0] * 5)


def _train(service, steps: int):
    """``steps`` steps on two data; per step the client's metrics and NLL per unit of weight,
    computed here from the logprobs the client got back."""
    tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
    ids = list(range(1, 13))
    data = [tt.Datum(model_input=tt.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:], "weights": w}) for w in WEIGHTS]
    results = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy").result()
        opt = tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
        nll = -sum(float(np.dot(out["logprobs"].to_numpy(), w)) for out, w in zip(fb.loss_fn_outputs, WEIGHTS, strict=True))
        results.append((fb.metrics, opt.metrics, nll / sum(map(sum, WEIGHTS))))
    return tc, results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n{OPS} ops operator\n")
    operators: set[str] = set()
    with ServerThread(tmp_path_factory.mktemp("state"), api_keys=read_api_keys(keys, operators),
                      operators=operators) as srv:
        alice, bob = srv.service_client(api_key=ALICE), srv.service_client(api_key=BOB)
        tc, results = _train(alice, 3)
        saved = tc.save_state("ckpt").result().path
        sampler_path = tc.save_weights_for_sampler("smp").result().path
        alice.create_sampling_client(model_path=sampler_path).result()
        bob_tc, _ = _train(bob, 1)
        yield dict(srv=srv, alice=alice, run=tc.model_id, results=results, saved=saved, sampler_path=sampler_path,
                   bob_run=bob_tc.model_id)
        alice.close("success").result()
        bob.close("success").result()


def test_an_owner_lists_their_own_runs_with_steps_status_and_sampling(world):
    with raw_client(world["srv"], ALICE) as http:
        page = http.get("/console/api/runs").json()
    assert page["total"] == 1 and [r["model_id"] for r in page["runs"]] == [world["run"]]
    run = page["runs"][0]
    assert (run["base_model"], run["lora_rank"], run["steps"], run["status"]) == ("tiny", 2, 3, "live")
    assert run["sampling_sessions"] == 1 and run["created"] <= run["last_request"]
    assert run["last"]["loss_per_token"] == pytest.approx(world["results"][-1][2], rel=1e-5)
    with raw_client(world["srv"], BOB) as http:
        assert [r["model_id"] for r in http.get("/console/api/runs").json()["runs"]] == [world["bob_run"]]


def test_curves_equal_what_the_client_got_back(world):
    with raw_client(world["srv"], ALICE) as http:
        c = http.get(f"/console/api/runs/{world['run']}/curves").json()
    assert c["steps"] == 3 and c["step"] == [1, 2, 3] and c["n"] == [1, 1, 1]
    for i, (fb, opt, nll_per_weight) in enumerate(world["results"]):
        s = {k: v["mean"][i] for k, v in c["series"].items()}
        assert s["loss_per_token"] == pytest.approx(nll_per_weight, rel=1e-5)
        assert s["loss_sum"] == pytest.approx(fb["loss:sum"], rel=1e-6) and s["tokens"] == 22.0
        assert (s["grad_norm"], s["learning_rate"], s["skipped"]) == (opt["grad_norm"], 1e-2, 0.0)
        assert s["seconds"] > 0
    assert c["series"]["loss_per_token"]["mean"][-1] < c["series"]["loss_per_token"]["mean"][0]  # it learns


def test_a_run_shows_its_checkpoints_with_paths_and_sizes(world):
    with raw_client(world["srv"], ALICE) as http:
        run = http.get(f"/console/api/runs/{world['run']}").json()
    found = {c["tinker_path"]: c for c in run["checkpoints"]}
    assert set(found) == {world["saved"], world["sampler_path"]}
    assert found[world["saved"]]["checkpoint_type"] == "training"
    assert all(c["size_bytes"] > 0 and c["time"] for c in found.values())
    assert len(run["sampling_session_ids"]) == 1


def test_another_owners_run_reads_as_unknown(world):
    with raw_client(world["srv"], BOB) as http:
        for path in (f"/console/api/runs/{world['run']}", f"/console/api/runs/{world['run']}/curves"):
            r = http.get(path)
            assert r.status_code == 404 and r.json()["detail"].startswith("unknown training run"), r.text


def test_the_server_view_is_for_operators(world):
    for key in (OPS, API_KEY):  # marked operator in --api-keys; the --api-key holder
        with raw_client(world["srv"], key) as http:
            me, srv = http.get("/console/api/me").json(), http.get("/console/api/server").json()
        assert me["operator"] is True
        (base,) = srv["bases"]
        owners = {a["model_id"]: a["owner"] for a in base["adapters"] if a["model_id"]}
        assert owners[world["run"]] == "alice" and owners[world["bob_run"]] == "bob"
        assert base["adapters_in_memory"] >= 2 and base["base_bytes"] > 0 and srv["memory"]["used_bytes"] > 0
        work = {w["owner"]: w for w in srv["work"]}
        assert work["alice"]["live_models"] == 1 and work["bob"]["live_models"] == 1
        limits = {row["setting"]: row["value"] for row in srv["limits"]}  # rows of server/settings.py's declaration
        assert limits["max_num_samples"] == 256 and limits["models"] == ["tiny"]
        assert (limits["sampler"], limits["sampler_config"]) == ("transformers", {})
        # the request and connection limits in force (this server runs with their defaults)
        assert (limits["max_tokens_per_request"], limits["max_queued_requests"],
                limits["header_timeout_s"]) == (524288, 1024, 10.0)
        assert 1 <= limits["max_connections"] <= 1000
        assert {row["flag"] for row in srv["limits"]} >= {"--max-memory", "--session-timeout", "--max-connections"}
    with raw_client(world["srv"], ALICE) as http:
        me = http.get("/console/api/me").json()
        assert (me["owner"], me["operator"], me["key_required"], me["models"]) == ("alice", False, True, ["tiny"])
        r = http.get("/console/api/server")
        assert r.status_code == 403 and "operators" in r.json()["detail"]


def test_runs_page_and_a_freed_run(world):
    service = world["srv"].service_client(api_key=ALICE)
    newer = service.create_lora_training_client(base_model="tiny", rank=2).result().model_id
    with raw_client(world["srv"], ALICE) as http:
        first = http.get("/console/api/runs", params={"limit": 1}).json()
        second = http.get("/console/api/runs", params={"limit": 1, "offset": 1}).json()
        assert (first["total"], [r["model_id"] for r in first["runs"] + second["runs"]]) == (2, [newer, world["run"]])
        service.close("success").result()
        assert http.get(f"/console/api/runs/{newer}").json()["status"] == "freed"
        for params, field in (({"limit": 0}, "limit"), ({"limit": 201}, "limit"), ({"offset": -1}, "offset")):
            r = http.get("/console/api/runs", params=params)
            detail = r.json()["detail"]
            assert r.status_code == 400 and detail.startswith(f"query parameter {field!r}: expected an integer"), r.text
        r = http.get(f"/console/api/runs/{world['run']}/curves", params={"points": 1})
        assert r.status_code == 400
        assert r.json()["detail"].startswith("query parameter 'points': expected an integer in 2..2000")


def test_the_page_needs_no_key_and_carries_no_data(world):
    with raw_client(world["srv"], None) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert '<script src="/console/console.js"' in page.text
        assert '<script src="/console/charts.js"' in page.text
        for path, media in (("/console/console.js", "text/javascript"), ("/console/charts.js", "text/javascript"),
                            ("/console/console.css", "text/css")):
            r = http.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith(media)
            assert world["run"] not in r.text
        assert world["run"] not in page.text and "alice" not in page.text
        assert http.get("/console/api/me").status_code == 401 and http.get("/console/other.js").status_code == 401


# ---- the catalog service (routes and console) ------------------------------------------------------
CATALOG_CALLS = {  # a catalog call, the store method it reaches
    "delete_checkpoint": (lambda c, tp: c.delete_checkpoint("alice", tp.run_id, tp.checkpoint_id), "delete_checkpoint"),
    "training_runs": (lambda c, tp: c.training_runs("alice", 10, 0), "list_runs"),
    "training_run": (lambda c, tp: c.training_run("alice", tp.run_id), "last_checkpoint"),
    "checkpoints": (lambda c, tp: c.checkpoints("alice", None, 10, 0), "list_checkpoints"),
    "weights_info": (lambda c, tp: c.weights_info("alice", str(tp)), "resolve_checkpoint"),
    "publish": (lambda c, tp: c.publish("alice", tp.run_id, tp.checkpoint_id, True), "update_checkpoint"),
    "set_ttl": (lambda c, tp: c.set_ttl("alice", tp.run_id, tp.checkpoint_id, None), "update_checkpoint"),
    "console_runs": (lambda c, tp: c.console_runs("alice", 10, 0), "list_runs"),
    "console_run": (lambda c, tp: c.console_run("alice", tp.run_id), "list_checkpoints"),
    "curves_body": (lambda c, tp: c.curves_body("alice", tp.run_id, 10), "run"),
}


@pytest.mark.parametrize("call", sorted(CATALOG_CALLS))
def test_catalog_calls_touch_the_store_off_the_event_loop(tmp_path, call):
    """The store's lock can be held by a save on the compute thread through a file sync, so every
    catalog call reaches the store on a thread: a store method that waits for the event loop
    (to answer another request) finishes; called on the loop it would wait for itself until HANG_S."""
    import asyncio
    import threading

    from _limits import HANG_S
    from skyrl_sdk.errors import NotFoundError
    from skyrl_sdk.server.compute.catalog import Catalog
    from skyrl_sdk.server.state.store import Store
    from skyrl_sdk.server.wire.tinker_paths import TinkerPath

    store = Store(tmp_path / "state")
    store.add_run("sess-1:train:0", "alice", "sess-1", "tiny", None, None)
    tp = TinkerPath("sess-1:train:0", "training", "ckpt")
    store.checkpoint_dir(tp).mkdir(parents=True)
    (store.checkpoint_dir(tp) / "weights.bin").write_bytes(b"x" * 10)
    store.add_checkpoint(tp)
    catalog = Catalog(store, History(tmp_path / "h.sqlite3"), {}, list)
    invoke, store_method = CATALOG_CALLS[call]
    loop_answered, reached = threading.Event(), threading.Event()
    real = getattr(store, store_method)

    def when_the_loop_answers(*args, **kwargs):
        reached.set()
        assert loop_answered.wait(HANG_S), f"{call} blocked the event loop"
        return real(*args, **kwargs)

    setattr(store, store_method, when_the_loop_answers)

    async def main():
        calling = asyncio.ensure_future(invoke(catalog, tp))
        await asyncio.sleep(0)  # the call has started; the loop still answers
        loop_answered.set()
        await calling

    asyncio.run(main())
    assert reached.is_set()
    setattr(store, store_method, real)
    if call == "delete_checkpoint":
        assert not store.checkpoint_dir(tp).exists() and store.checkpoint(tp, "alice") is None
        with pytest.raises(NotFoundError):  # another owner's checkpoint reads as unknown
            asyncio.run(catalog.delete_checkpoint("bob", tp.run_id, tp.checkpoint_id))
    catalog.history.close()
    store.close()


def test_a_step_is_in_the_database_when_its_optim_step_returns(tmp_path):
    """What the server acknowledges to a client is written: another connection reads every step
    at once, with no flush and no close (before: written once a second, so a kill -9 right after
    an acknowledged step lost it)."""
    h = History(tmp_path / "db", flush_s=3600)
    _record(h, "r", [3.0, 2.0, 1.0])
    with sqlite3.connect(tmp_path / "db") as c:
        assert c.execute("SELECT steps FROM metrics_runs WHERE run_id = 'r'").fetchone() == (3,)
    assert _rows(tmp_path / "db", "r") == 3
    h.close()


def test_the_banner_and_the_page_say_a_key_link_stays_in_the_browser_history(tmp_path):
    """The page drops ``#key=`` from the address bar, but the browser has already recorded the
    link in its history files: said where a user meets the link (before: said nowhere)."""
    from skyrl_sdk.cli.serve import console_hint

    assert "keeps the link, key and all, in its history" in console_hint("http://h:1", needs_key=True)
    with ServerThread(tmp_path / "state") as srv, raw_client(srv, api_key=None) as http:
        assert "keeps the link, key and all, in its" in " ".join(http.get("/").text.split())


def test_the_console_limits_table_is_the_declaration():
    """The limits table holds every setting server/settings.py marks for the console, by its flag,
    with the value in force (tests/test_settings.py holds the rest to the declaration)."""
    from types import SimpleNamespace

    from skyrl_sdk.server import settings
    from skyrl_sdk.server.http import console

    config = ServerConfig(max_memory="8GiB", max_connections=7)
    rows = console.limits_table(SimpleNamespace(config=config))
    assert [r["setting"] for r in rows] == [s.name for s in settings.SETTINGS if s.console]
    for row in rows:
        assert row["value"] == getattr(config, row["setting"]) and row["flag"] == settings.BY_NAME[row["setting"]].flag
    by_name = {r["setting"]: r for r in rows}
    assert by_name["max_memory"]["unit"] == "bytes" and by_name["max_lora_adapters"]["unset"] == "no limit"
# ---- RL steps -------------------------------------------------------------------------------------------------
def _rl_data(rng, n_datums: int, weights: bool) -> list[types.Datum]:
    """RL datums: a prompt of 3 positions (advantage 0), a completion with the datum's advantage."""
    out = []
    for _ in range(n_datums):
        n = int(rng.integers(2, 6))
        adv = [0.0] * 3 + [float(rng.normal())] * n
        inputs = {"target_tokens": list(range(2, 5 + n)), "logprobs": [-1.0] * (3 + n), "advantages": adv}
        if weights:
            inputs["weights"] = [0.0] * 3 + [1.0] * n
        out.append(types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 4 + n))), loss_fn_inputs=inputs))
    return out


@pytest.mark.parametrize("weights", [False, True])
def test_an_rl_step_has_its_advantages_tokens_and_the_losses_statistics(tmp_path, weights):
    """Two forward_backward calls of one step merge exactly: advantage mean / std over the scored
    positions of both (numpy over the raw values), sampled tokens, token-weighted KL and clip
    fraction, the larger ratio max, the entropy per scored token; the run is an RL run with its loss."""
    rng = np.random.default_rng(3)
    calls = [_rl_data(rng, 3, weights), _rl_data(rng, 2, weights)]
    metrics = [{"loss:sum": 1e-7, "num_tokens:sum": 20.0, "num_loss_tokens:sum": 8.0, "kl_sample_train:mean": 0.01,
                "clip_fraction:mean": 0.25, "ratio_max:max": 1.5, "entropy_loss:sum": 16.0},
               {"loss:sum": -1e-7, "num_tokens:sum": 12.0, "num_loss_tokens:sum": 4.0, "kl_sample_train:mean": 0.04,
                "clip_fraction:mean": 0.5, "ratio_max:max": 1.25, "entropy_loss:sum": 4.0}]
    h = History(tmp_path / "db", flush_s=3600, write_through=False)
    for m, data in zip(metrics, calls, strict=True):
        h.forward_backward("r", m, time.time(), data, "stable_reinforce")
    h.optim_step("r", {"step": 1.0, "grad_norm": 1.0, "learning_rate": 1e-3, "skipped": 0.0})
    h.optim_step("r", {"step": 2.0, "grad_norm": 0.0, "learning_rate": 1e-3, "skipped": 0.0})  # nothing trained on
    c = h.curves("r")
    s = {k: v["mean"] for k, v in c["series"].items()}
    scored = np.concatenate([d.loss_fn_inputs["advantages"].to_numpy()[3:] for data in calls for d in data]).astype(np.float64)
    assert s["advantage_mean"][0] == pytest.approx(scored.mean(), abs=1e-12)
    assert s["advantage_std"][0] == pytest.approx(scored.std(), rel=1e-9)
    assert s["sampled_tokens"] == [float(scored.size), None] and s["rl"] == [1.0, None]
    assert s["kl_sample_train"][0] == pytest.approx((0.01 * 8 + 0.04 * 4) / 12, rel=1e-12)
    assert s["clip_fraction"][0] == pytest.approx((0.25 * 8 + 0.5 * 4) / 12, rel=1e-12)
    assert s["ratio_max"] == [1.5, None] and s["entropy"][0] == pytest.approx(20.0 / 12, rel=1e-12)
    assert c["losses"] == ["stable_reinforce"]
    last = h.summaries(["r"])["r"]["last"]
    assert last["loss_fn"] == "stable_reinforce" and last["rl_run"] is True  # carried over a step with nothing
    h.close()


def test_a_supervised_step_has_no_rl_series_and_history_written_before_them_still_reads(tmp_path):
    h = History(tmp_path / "db", flush_s=3600)
    _record(h, "r", [1.0, 2.0])
    c = h.curves("r")
    assert c["series"]["rl"]["mean"] == [0.0, 0.0]
    assert all(c["series"][k]["mean"] == [None, None] for k in ("advantage_mean", "kl_sample_train", "ratio_max"))
    h.close()
    with sqlite3.connect(tmp_path / "db") as db:  # a bucket written before the RL series existed
        import json

        for bucket, agg in db.execute("SELECT bucket, agg FROM metrics").fetchall():
            doc = json.loads(agg)
            doc["m"] = {k: v for k, v in doc["m"].items() if k in ("loss_per_token", "loss_sum", "grad_norm")}
            db.execute("UPDATE metrics SET agg = ? WHERE bucket = ?", (json.dumps(doc), bucket))
    h = History(tmp_path / "db", flush_s=3600)
    _record(h, "r", [3.0], first_step=3)
    c = h.curves("r", points=2)
    assert c["series"]["loss_per_token"]["mean"][0] == pytest.approx(1.5) and c["series"]["rl"]["mean"][-1] == 0.0
    h.close()
