"""The console in a real browser: headless Chromium opens ``GET /`` with an owner's key in the
URL fragment after a short training run through the tinker client, and the page it rendered
(the DOM after its scripts ran) shows that owner's run, its loss curve and its checkpoint, and
nothing of another owner's run.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it). Without it these tests
fail, unless ``SKYRL_SDK_SKIP_BROWSER_TESTS=1`` says to skip them on a machine that cannot have
it. ``SKYRL_SDK_CONSOLE_SCREENSHOT=FILE`` also writes the owner's page as a PNG there.
"""

from __future__ import annotations

import html.parser
import os
import shutil
import subprocess

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _server_harness import ServerThread
from skyrl_sdk.server.config import read_api_keys

SKIP_ENV = "SKYRL_SDK_SKIP_BROWSER_TESTS"
ALICE, BOB = "tml-alice", "tml-bob"
STEPS = 4


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(f"no chromium on this machine ({SKIP_ENV}=1)")
        pytest.fail(f"the console's browser test needs Chromium: apt-get install chromium (.ci/run does), or set "
                    f"{SKIP_ENV}=1 on a machine that cannot have it")
    return found


def run_chromium(tmp_path, url: str, *args: str) -> str:
    """Headless Chromium on ``url`` (scripts get 15 s of virtual time); its stdout."""
    cmd = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=15000", *args, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


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


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    chromium()  # fail (or skip) before training when there is no browser
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    with ServerThread(tmp_path_factory.mktemp("state"), api_keys=read_api_keys(keys)) as srv:
        alice, bob = srv.service_client(api_key=ALICE), srv.service_client(api_key=BOB)
        run, checkpoint = _train(alice, STEPS, "first-save")
        bob_run, _ = _train(bob, 1, None)
        srv.runtime.history.flush()
        yield dict(srv=srv, run=run, checkpoint=checkpoint, bob_run=bob_run)
        alice.close("success").result()
        bob.close("success").result()


def test_an_owner_sees_their_run_curve_and_checkpoint_and_nothing_of_another(world, tmp_path):
    page = run_chromium(tmp_path, f"{world['srv'].url}/#key={ALICE}", "--dump-dom")
    dom = Elements(page)
    assert dom.by(id="error")[0][2].strip() == "", dom.by(id="error")
    assert "hidden" in dom.by(id="login")[0][1] and "hidden" not in dom.by(id="app")[0][1]
    assert [a["data-run-id"] for t, a, _ in dom.found if t == "tr" and "data-run-id" in a] == [world["run"]]
    assert dom.by(id="run-title")[0][2] == world["run"]
    lines = {a["data-series"]: a for t, a, _ in dom.found if t == "path" and a.get("class") == "line"}
    assert len(lines) == 7  # every curve drawn
    loss = lines["loss_per_token"]
    assert loss["data-points"] == str(STEPS) and loss["d"].count("L") == STEPS - 1  # a point per step, joined
    assert [a["data-path"] for _, a, _ in dom.by() if "data-path" in a] == [world["checkpoint"]]
    assert any(text == world["checkpoint"] for t, _, text in dom.by() if t == "code")
    assert world["bob_run"] not in page and "bob" not in page
    if target := os.environ.get("SKYRL_SDK_CONSOLE_SCREENSHOT"):
        run_chromium(tmp_path, f"{world['srv'].url}/#key={ALICE}", f"--screenshot={target}",
                     "--window-size=1400,1000", "--hide-scrollbars")


def test_the_other_owner_sees_only_theirs(world, tmp_path):
    page = run_chromium(tmp_path, f"{world['srv'].url}/#key={BOB}", "--dump-dom")
    assert world["bob_run"] in page and world["run"] not in page and world["checkpoint"] not in page


def test_without_a_key_the_page_asks_for_one_and_shows_nothing_else(world, tmp_path):
    for url in (f"{world['srv'].url}/", f"{world['srv'].url}/#key=tml-unknown"):
        dom = Elements(run_chromium(tmp_path, url, "--dump-dom"))
        assert "hidden" not in dom.by(id="login")[0][1] and "hidden" in dom.by(id="app")[0][1]
        assert not [a for _, a, _ in dom.by() if "data-run-id" in a or "data-path" in a]
        assert ("not known" in dom.by(id="login-error")[0][2]) == url.endswith("unknown")


def test_a_screenshot_renders(world, tmp_path):
    shot = tmp_path / "console.png"
    run_chromium(tmp_path, f"{world['srv'].url}/#key={ALICE}", f"--screenshot={shot}", "--window-size=1400,1000")
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000


def test_a_server_without_keys_opens_at_once_with_the_server_view(tmp_path):
    chromium()
    with ServerThread(tmp_path / "state", api_key=None) as srv:
        dom = Elements(run_chromium(tmp_path, f"{srv.url}/", "--dump-dom"))
    assert "hidden" in dom.by(id="login")[0][1] and "hidden" not in dom.by(id="app")[0][1]
    assert "hidden" not in dom.by(id="server-panel")[0][1] and "hidden" not in dom.by(id="runs-empty")[0][1]
    assert "(operator)" in dom.by(id="who")[0][2] and dom.by(id="error")[0][2].strip() == ""
