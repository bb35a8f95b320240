"""The console in a real browser: headless Chromium opens ``GET /`` with an owner's key in the
URL fragment after a short training run through the tinker client, and the page it rendered
(the DOM after its scripts ran) shows that owner's run, its loss curve and its checkpoint, and
nothing of another owner's run; and a mouse moved over a curve's point (DevTools input events)
shows that point's exact value. An RL run leads with its RL curves (loss per token is not its
headline), a second run is drawn on the same axes, the charts sit in a grid with the
checkpoints above them at 1400x1000, a run whose client went away says so, and the operator's
view says whose models it shows.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it). Without it these tests
fail, unless ``SKYRL_SDK_SKIP_BROWSER_TESTS=1`` says to skip them on a machine that cannot have
it. ``SKYRL_SDK_CONSOLE_SCREENSHOT=FILE`` also writes the owner's page as a PNG there,
``SKYRL_SDK_CONSOLE_KEY_FORM_SCREENSHOT=FILE`` the key form (docs/console-key-form.png),
``SKYRL_SDK_CONSOLE_RL_SCREENSHOT=FILE`` an RL run compared with another (docs/console-rl.png),
``SKYRL_SDK_CONSOLE_OPERATOR_SCREENSHOT=FILE`` the operator's view (docs/console-operator.png).
What a person sees is checked on Chromium's layout (boxes, computed style), not on attributes.
"""

from __future__ import annotations

import base64
import html.parser
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _limits import HANG_S
from _server_harness import ServerThread, raw_client
from skyrl_sdk.server.config import read_api_keys

SKIP_ENV = "SKYRL_SDK_SKIP_BROWSER_TESTS"
ALICE, BOB, OPS = "tml-alice", "tml-bob", "tml-ops"
STEPS = 4
RL_STEPS = 3


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(f"no chromium on this machine ({SKIP_ENV}=1)")
        pytest.fail(f"the console's browser test needs Chromium: apt-get install chromium (.ci/run does), or set "
                    f"{SKIP_ENV}=1 on a machine that cannot have it")
    return found


CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


def run_chromium(tmp_path, url: str, *args: str) -> str:
    """Headless Chromium on ``url`` (scripts get 15 s of virtual time); its stdout."""
    cmd = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}",
           "--virtual-time-budget=15000", *args, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


class DevTools:
    """Chromium driven through its DevTools protocol over a pipe (it reads commands on fd 3 and
    writes answers on fd 4, JSON messages ending in NUL), to move a real mouse over the page."""

    def __init__(self, tmp_path, url: str) -> None:
        commands_r, self._commands = os.pipe()
        self._answers, answers_w = os.pipe()
        self.proc = subprocess.Popen(  # bash, not sh: dash redirects only one-digit fds
            ["bash", "-c", f'exec "$0" "$@" 3<&{commands_r} 4>&{answers_w}', chromium(), *CHROMIUM_FLAGS,
             f"--user-data-dir={tmp_path / 'chromium-devtools'}", "--remote-debugging-pipe",
             "--window-size=1400,1000", url],
            pass_fds=(commands_r, answers_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands_r)
        os.close(answers_w)
        self._next_id, self._buffer, self.session = 0, b"", None
        page = next(t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]

    def send(self, method: str, **params):
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + HANG_S
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._next_id:
                    assert "error" not in answer, answer
                    return answer["result"]
            ready, _, _ = select.select([self._answers], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no answer to {method} from Chromium in {HANG_S} s"
            chunk = os.read(self._answers, 1 << 16)
            assert chunk, f"Chromium closed its DevTools pipe (exit {self.proc.poll()})"
            self._buffer += chunk

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_for(self, expression: str):
        deadline = time.monotonic() + HANG_S
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"the page never had {expression}"
            time.sleep(0.2)
        return value

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=HANG_S)
        os.close(self._commands)
        os.close(self._answers)


class Elements(html.parser.HTMLParser):
    """Every element of a page as (tag, attributes, its own text)."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str], list[str]]] = []
        self._open: list[list[str]] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, {k: v or "" for k, v in attrs}, []))
        self._open.append(self.found[-1][2])

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        if self._open:
            self._open[-1].append(data)

    def by(self, **attrs) -> list[tuple[str, dict[str, str], str]]:
        return [(t, a, "".join(x)) for t, a, x in self.found
                if all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


def _train(service, steps: int, save: str | None):
    tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
    ids = list(range(1, 17))
    datum = tt.Datum(model_input=tt.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
    return tc.model_id, tc.save_state(save).result().path if save else None


def _train_rl(service, loss: str, seed: int) -> str:
    """RL_STEPS steps of ``loss`` on groups sampled through the client (datums with provenance)."""
    from skyrl_sdk.rl import group_advantages, tinker_datum_from_sample

    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    prompt = [1, 5 + seed, 6, 7]
    for step in range(RL_STEPS):
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        seqs = sampler.sample(tt.ModelInput.from_ints(prompt), 6, tt.SamplingParams(max_tokens=4, seed=seed + step,
                                                                                    stop=[])).result().sequences
        rewards = [float(s.tokens[0] % 2) for s in seqs]  # about half the samples: mixed groups
        data = [tinker_datum_from_sample(prompt, s, a) for s, a in zip(seqs, group_advantages(rewards), strict=True) if a]
        if data:
            tc.forward_backward(data, loss).result()
        tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
    return tc.model_id


GONE_CLIENT = """
import os, sys
import tinker
from tinker import types as tt
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
ids = list(range(1, 9))
datum = tt.Datum(model_input=tt.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
tc.forward_backward([datum], "cross_entropy").result()
tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
print(tc.model_id, flush=True)
os._exit(0)  # the script ends without close(): its session waits for --session-timeout
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    chromium()  # fail (or skip) before training when there is no browser
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n{OPS} ops operator\n")
    operators: set[str] = set()
    with ServerThread(tmp_path_factory.mktemp("state"), api_keys=read_api_keys(keys, operators),
                      operators=operators) as srv:
        alice, bob = srv.service_client(api_key=ALICE), srv.service_client(api_key=BOB)
        run, checkpoint = _train(alice, STEPS, "first-save")
        bob_run, _ = _train(bob, 1, None)
        carol = srv.service_client(api_key=BOB)  # another session, for the RL runs
        rl_runs = [_train_rl(carol, "stable_reinforce", 0), _train_rl(carol, "importance_sampling", 1)]
        gone = subprocess.run([sys.executable, "-c", GONE_CLIENT, srv.url, BOB], capture_output=True, text=True,
                              timeout=HANG_S)
        assert gone.returncode == 0, gone.stderr[-2000:]
        gone_run = gone.stdout.split()[-1]
        session = srv.runtime.models[gone_run].session_id
        srv.runtime.loop.call_soon_threadsafe(  # its client has been silent for a minute
            srv.runtime.sessions.seen, session, time.monotonic() - 60.0)
        srv.runtime.history.flush()
        yield dict(srv=srv, run=run, checkpoint=checkpoint, bob_run=bob_run, rl_runs=rl_runs, gone_run=gone_run)
        alice.close("success").result()
        bob.close("success").result()
        carol.close("success").result()


def test_an_owner_sees_their_run_curve_and_checkpoint_and_nothing_of_another(world, tmp_path):
    page = run_chromium(tmp_path, f"{world['srv'].url}/#key={ALICE}", "--dump-dom")
    dom = Elements(page)
    assert dom.by(id="error")[0][2].strip() == "", dom.by(id="error")
    assert "hidden" in dom.by(id="login")[0][1] and "hidden" not in dom.by(id="app")[0][1]
    assert [a["data-run-id"] for t, a, _ in dom.found if t == "tr" and "data-run-id" in a] == [world["run"]]
    assert dom.by(id="run-title")[0][2] == world["run"]
    lines = {a["data-series"]: a for t, a, _ in dom.found if t == "path" and "line" in a.get("class", "").split()}
    # every curve with values drawn: a supervised run has no RL curves, and MFU has no point on CPU (no peak known)
    assert set(lines) == {"loss_per_token", "loss_sum", "grad_norm", "entropy", "learning_rate", "tokens", "seconds",
                          "skipped", "tokens_per_second"}
    assert lines["tokens_per_second"]["data-points"] == str(STEPS)
    loss = lines["loss_per_token"]
    assert loss["data-points"] == str(STEPS) and loss["d"].count("L") == STEPS - 1  # a point per step, joined
    assert [a["data-path"] for _, a, _ in dom.by() if "data-path" in a] == [world["checkpoint"]]
    assert any(text == world["checkpoint"] for t, _, text in dom.by() if t == "code")
    assert world["bob_run"] not in page and "bob" not in page
    if target := os.environ.get("SKYRL_SDK_CONSOLE_SCREENSHOT"):
        run_chromium(tmp_path, f"{world['srv'].url}/#key={ALICE}", f"--screenshot={target}",
                     "--window-size=1400,1000", "--hide-scrollbars")


def test_the_mouse_over_a_point_shows_its_exact_value(world, tmp_path):
    """A real mouse move (DevTools Input events) over the loss curve's third point shows that
    step and its value with every digit the server stored."""
    with raw_client(world["srv"], ALICE) as http:
        curves = http.get(f"/console/api/runs/{world['run']}/curves").json()
    browser = DevTools(tmp_path, f"{world['srv'].url}/#key={ALICE}")
    try:
        dots = 'document.querySelectorAll(\'svg[data-series="loss_per_token"] circle.dot\')'
        assert browser.wait_for(f"{dots}.length") == STEPS
        x, y = browser.evaluate(f"(() => {{ const d = {dots}[2]; d.scrollIntoView({{block: 'center'}}); "
                                "const r = d.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        assert browser.evaluate("document.getElementById('tooltip').hidden") is True
        browser.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        lines = browser.wait_for("(() => { const t = document.getElementById('tooltip'); "
                                 "return t.hidden ? null : [...t.children].map((c) => c.textContent); })()")
        marker = browser.evaluate('document.querySelector(\'svg[data-series="loss_per_token"] line.marker\')'
                                  '.getAttribute("visibility")')
    finally:
        browser.close()
    step, value = curves["step"][2], curves["series"]["loss_per_token"]["mean"][2]
    assert lines[0] == f"step {step}" and marker == "visible"
    title, shown = lines[1].split(": ")
    assert title == "loss per token" and float(shown) == value  # exact: the same float, not a rounding


def test_the_other_owner_sees_only_theirs(world, tmp_path):
    page = run_chromium(tmp_path, f"{world['srv'].url}/#key={BOB}", "--dump-dom")
    assert world["bob_run"] in page and world["run"] not in page and world["checkpoint"] not in page


def test_without_a_key_the_page_asks_for_one_and_shows_nothing_else(world, tmp_path):
    for url in (f"{world['srv'].url}/", f"{world['srv'].url}/#key=tml-unknown"):
        dom = Elements(run_chromium(tmp_path, url, "--dump-dom"))
        assert "hidden" not in dom.by(id="login")[0][1] and "hidden" in dom.by(id="app")[0][1]
        assert not [a for _, a, _ in dom.by() if "data-run-id" in a or "data-path" in a]
        assert ("not known" in dom.by(id="login-error")[0][2]) == url.endswith("unknown")


#: (id, visible size) of every element the page has marked ``hidden`` yet the browser draws:
#: a CSS ``display`` rule on it (``main { display: grid }``) overrides the attribute.
DRAWN_THOUGH_HIDDEN = ("[...document.querySelectorAll('[hidden]')].filter((e) => e.getClientRects().length)"
                       ".map((e) => [e.id || e.tagName, e.getBoundingClientRect().width])")


def drawn(browser: DevTools, selector: str) -> bool:
    """Whether the browser draws ``selector``'s element: a box with an area, not ``display: none``
    on it or on any ancestor (what a person sees, not the attribute)."""
    return browser.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                            "const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0 "
                            "&& e.checkVisibility(); })()")


def test_the_key_form_shows_only_the_key_form(world, tmp_path):
    """Without a key the page draws the key form and nothing of the app: no "Training runs"
    table, no paging buttons, no element marked hidden (computed layout in Chromium, not the
    attribute). ``docs/console-key-form.png`` is this page (module docstring: how to rewrite it)."""
    browser = DevTools(tmp_path, f"{world['srv'].url}/")
    try:
        browser.wait_for("(() => { const e = document.getElementById('login'); return e && !e.hidden; })()")
        assert drawn(browser, "#login-form") and drawn(browser, "#key-input")
        for hidden in ("#app", "#runs-panel", "#runs", "#prev", "#next", "#forget"):
            assert not drawn(browser, hidden), hidden
        assert browser.evaluate("getComputedStyle(document.getElementById('app')).display") == "none"
        assert browser.evaluate(DRAWN_THOUGH_HIDDEN) == []
        assert "Training runs" not in browser.evaluate("document.body.innerText")
        browser.send("Emulation.setDeviceMetricsOverride", width=900, height=520, deviceScaleFactor=1, mobile=False)
        shot = browser.send("Page.captureScreenshot", format="png")["data"]
    finally:
        browser.close()
    png = base64.b64decode(shot)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "console-key-form.png").write_bytes(png)
    if target := os.environ.get("SKYRL_SDK_CONSOLE_KEY_FORM_SCREENSHOT"):
        Path(target).write_bytes(png)


def test_nothing_marked_hidden_is_drawn_on_an_owners_page(world, tmp_path):
    browser = DevTools(tmp_path, f"{world['srv'].url}/#key={ALICE}")
    try:
        browser.wait_for("document.querySelectorAll('#runs tbody tr').length")
        assert drawn(browser, "#runs-panel") and drawn(browser, "#prev")
        assert browser.evaluate(DRAWN_THOUGH_HIDDEN) == []
        assert not drawn(browser, "#login")
    finally:
        browser.close()


def test_a_screenshot_renders(world, tmp_path):
    shot = tmp_path / "console.png"
    run_chromium(tmp_path, f"{world['srv'].url}/#key={ALICE}", f"--screenshot={shot}", "--window-size=1400,1000")
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000


def test_a_server_without_keys_opens_at_once_with_the_server_view(tmp_path):
    chromium()
    with ServerThread(tmp_path / "state", api_key=None) as srv:
        html = run_chromium(tmp_path, f"{srv.url}/", "--dump-dom")
        dom = Elements(html)
    assert "hidden" in dom.by(id="login")[0][1] and "hidden" not in dom.by(id="app")[0][1]
    assert "hidden" not in dom.by(id="server-panel")[0][1] and "hidden" not in dom.by(id="runs-empty")[0][1]
    # the limits table: a row per setting server/settings.py marks for the console, by its flag
    assert "<td>--session-timeout</td><td>300 s</td>" in html and "<td>--max-lora-adapters</td><td>no limit</td>" in html
    assert "(operator)" in dom.by(id="who")[0][2] and dom.by(id="error")[0][2].strip() == ""


# ---- an RL run, two runs compared, the layout at 1400x1000, a client that went away, the operator ---------
CHART_BOXES = ("[...document.querySelectorAll('figure.chart')].map((f) => { const r = f.getBoundingClientRect(); "
               "return [f.dataset.series, Math.round(r.x), Math.round(r.y), Math.round(r.width), "
               "f.closest('.chart-grid') ? [...document.querySelectorAll('.chart-grid')].indexOf(f.closest('.chart-grid')) "
               ": -1]; })")


def test_an_rl_run_leads_with_its_rl_curves_in_a_grid_with_its_checkpoints_above(world, tmp_path):
    run = world["rl_runs"][0]
    browser = DevTools(tmp_path, f"{world['srv'].url}/#key={BOB}&run={run}")
    try:
        browser.wait_for("document.querySelectorAll('figure.chart').length")
        boxes = browser.evaluate(CHART_BOXES)
        groups = browser.evaluate("[...document.querySelectorAll('h3.chart-group')].map((h) => h.textContent)")
        note = browser.evaluate("document.querySelector('figure[data-series=\"loss_per_token\"] .chart-note')"
                                ".textContent")
        checkpoints_top = browser.evaluate("document.getElementById('checkpoints-box').getBoundingClientRect().top")
        charts_top = browser.evaluate("document.getElementById('charts').getBoundingClientRect().top")
        row = browser.evaluate("[...document.querySelectorAll('#runs tbody tr')].find((r) => r.dataset.runId === "
                               f"{json.dumps(run)}).innerText")
    finally:
        browser.close()
    series = [b[0] for b in boxes]
    assert groups[0].startswith("RL") and groups[1] == "Training"
    assert series[:5] == ["advantage_mean", "advantage_std", "kl_sample_train", "ratio_max", "clip_fraction"]
    assert series.index("sampled_tokens") < series.index("loss_per_token")  # loss per token is not the headline
    assert "not a measure of progress" in note
    assert "stable_reinforce" in row and "RL: KL s−t" in row and "loss/token" not in row
    # a grid: every chart of a group the same width, in rows of at least 3 at 1400 px; none alone in a row
    # that could hold it beside the others (a group starts its own grid)
    for grid in {b[4] for b in boxes}:
        cells = [b for b in boxes if b[4] == grid]
        assert len({b[3] for b in cells}) == 1 and grid >= 0
        rows = {}
        for b in cells:
            rows.setdefault(b[2], []).append(b)
        per_row = [len(r) for _, r in sorted(rows.items())]
        assert per_row[0] >= 3 and all(n == per_row[0] for n in per_row[:-1]), per_row
    assert checkpoints_top < charts_top < 1000  # the checkpoints above the charts, the charts start on screen


def test_a_second_run_is_drawn_on_the_same_axes(world, tmp_path):
    first, second = world["rl_runs"]
    browser = DevTools(tmp_path, f"{world['srv'].url}/#key={BOB}&run={first}")
    try:
        browser.wait_for("document.querySelectorAll('figure.chart').length")
        options = browser.evaluate("[...document.getElementById('compare').options].map((o) => o.value)")
        browser.evaluate(f"(() => {{ const s = document.getElementById('compare'); s.value = {json.dumps(second)}; "
                         "s.dispatchEvent(new Event('change')); })()")
        paths = browser.wait_for("(() => { const p = [...document.querySelectorAll('svg[data-series=\"grad_norm\"] "
                                 "path.line')].map((e) => [e.dataset.run, e.getAttribute('d')]); "
                                 "return p.length === 2 ? p : null; })()")
        legend = browser.evaluate("document.getElementById('legend').innerText")
        if target := os.environ.get("SKYRL_SDK_CONSOLE_RL_SCREENSHOT"):
            Path(target).write_bytes(base64.b64decode(browser.send("Page.captureScreenshot", format="png")["data"]))
    finally:
        browser.close()
    assert options[0] == "" and second in options and first not in options
    assert {r for r, _ in paths} == {first, second} and first in legend and second in legend
    for _, d in paths:  # both inside the plot: one y axis spans both runs
        ys = [float(pair.split(",")[1]) for pair in d.replace("M", " ").replace("L", " ").split()]
        assert all(10 - 0.5 <= y <= 190 - 24 + 0.5 for y in ys), d


def test_a_run_whose_client_went_away_says_so(world, tmp_path):
    with raw_client(world["srv"], BOB) as http:
        rows = {r["model_id"]: r for r in http.get("/console/api/runs").json()["runs"]}
    gone = rows[world["gone_run"]]
    assert gone["status"] == "gone" and gone["client_silent_s"] >= 60
    assert all(r["status"] != "gone" for i, r in rows.items() if i != world["gone_run"])  # live clients are not
    dom = Elements(run_chromium(tmp_path, f"{world['srv'].url}/#key={BOB}", "--dump-dom"))
    [(_, attrs, text)] = [e for e in dom.by() if e[0] == "span" and "gone" in e[1].get("class", "")]
    assert text == "client gone" and "--session-timeout (300 s)" in attrs["title"]


def test_the_operator_view_says_whose_models_it_shows(world, tmp_path):
    browser = DevTools(tmp_path, f"{world['srv'].url}/#key={OPS}")
    try:
        browser.wait_for("(() => { const s = document.getElementById('server'); return s && s.innerText.length; })()")
        runs_title = browser.evaluate("document.querySelector('#runs-panel h2').innerText")
        server_title = browser.evaluate("document.querySelector('#server-panel h2').innerText")
        owners = browser.evaluate("document.getElementById('server').innerText")
        if target := os.environ.get("SKYRL_SDK_CONSOLE_OPERATOR_SCREENSHOT"):
            Path(target).write_bytes(base64.b64decode(browser.send("Page.captureScreenshot", format="png")["data"]))
    finally:
        browser.close()
    assert runs_title.startswith("Training runs of owner ops") and "(0)" in runs_title
    assert server_title.startswith("Server: every owner's models and work") and "only your own" in server_title
    assert "alice" in owners and "bob" in owners
