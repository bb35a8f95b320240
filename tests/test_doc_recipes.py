"""The documented recipes compose: the plugin guide's loss takes the RL recipe's datums, a
reference model's forward takes the policy's datums, and skyrl-parity.md's PPO + KL block runs
as written. Input keys stay strict where it matters: ``forward_backward`` refuses a key its
loss does not read, and a key no loss reads is refused everywhere."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest

import skyrl_sdk
from skyrl_sdk import builtin_plugins as plugins
from skyrl_sdk import types
from skyrl_sdk.errors import DatumError, InputError
from skyrl_sdk.rl import datum_from_sample, with_ref_logprobs

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end != -1 else None]


def rl_datums(weights: bool = False) -> list[types.Datum]:
    """What docs/rl.md builds: prompt + sampled completion, the sampler's logprobs, advantages."""
    samples = [types.SampledSequence(tokens=[55, 56, 257], logprobs=[-0.5, -1.0, -2.0], stop_reason="stop"),
               types.SampledSequence(tokens=[57, 58], logprobs=[-1.5, -0.25], stop_reason="length")]
    prompts = [[256, 51, 50, 63], [256, 52, 63]]
    return [datum_from_sample(p, s, a, weights=weights) for p, s, a in zip(prompts, samples, (1.0, -1.0), strict=True)]


# ---- docs/plugins.md: the guide's loss on docs/rl.md's datums ---------------------------------------------
def guide_loss_module() -> str:
    return python_blocks(section((DOCS / "plugins.md").read_text(), "## 3. The loss"))[0]


def registration(source: str) -> dict:
    """The keyword arguments the module's ``skyrl_sdk_register_losses`` hook registers with."""
    namespace: dict = {}
    exec(compile(source, "plugins.md", "exec"), namespace)
    calls = []
    namespace["skyrl_sdk_register_losses"](lambda name, fn, **kw: calls.append((name, kw)))
    [(name, kwargs)] = calls
    return {"name": name, **kwargs}


def test_the_guide_builds_the_plugin_that_ships():
    """Section 3 of the guide registers exactly what plugins/skyrl-sdk-reinforce registers."""
    import skyrl_sdk_reinforce

    shipped = registration(inspect.getsource(skyrl_sdk_reinforce))
    assert registration(guide_loss_module()) == shipped
    assert "logprobs" in shipped["optional_inputs"]


def test_the_guide_loss_trains_on_the_rl_recipes_datums(fresh_plugins, plugin_site, monkeypatch):
    """The guide's code, installed as a plugin of its own, takes datum_from_sample's datums and
    gives -sum(advantages * logprobs) over the completion tokens."""
    plugin_site("guide-reinforce", {"guide_reinforce": guide_loss_module()}, {"guide": "guide_reinforce"})
    monkeypatch.setenv("SKYRL_SDK_PLUGINS", "guide")  # the guide's copy, not the installed package
    data = rl_datums()
    with skyrl_sdk.Backend(model="tiny", seed=0) as backend:
        assert plugins.get_registry().owners[("loss", "reinforce")] == "guide"
        out = backend.forward_backward(data, "reinforce")
    expected = sum(-float(np.dot(d.loss_fn_inputs["advantages"].to_numpy(), o["logprobs"].to_numpy()))
                   for d, o in zip(data, out.loss_fn_outputs, strict=True))
    assert out.metrics["pg_loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert out.metrics["num_loss_tokens:sum"] == 5  # the completion tokens, not the prompts


# ---- forward takes what its loss reads; forward_backward stays strict ------------------------------------
def test_reference_forward_takes_the_policys_datums_as_they_are(tiny_backend):
    """A forward with cross_entropy on datums carrying logprobs, advantages and ref_logprobs
    scores exactly what it scores on the same datums with target_tokens and weights alone."""
    rich = with_ref_logprobs(rl_datums(weights=True), tiny_backend.forward(rl_datums(), "cross_entropy"))
    plain = [types.Datum(model_input=d.model_input,
                         loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")})
             for d in rich]
    got, want = tiny_backend.forward(rich, "cross_entropy"), tiny_backend.forward(plain, "cross_entropy")
    assert got.metrics == want.metrics
    for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(g["logprobs"].to_numpy(), w["logprobs"].to_numpy())
    assert set(rich[0].loss_fn_inputs) == {"target_tokens", "logprobs", "advantages", "weights", "ref_logprobs"}


def test_keys_stay_strict_where_they_would_change_a_result(tiny_backend):
    data = rl_datums()
    with pytest.raises(DatumError, match=r"\['logprobs'\]: loss 'cross_entropy' does not take this input"):
        tiny_backend.forward_backward(data, "cross_entropy")  # training: an unread key is refused
    typo = [types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "wieghts": np.ones(
        d.model_input.length, np.float32)}) for d in data]
    with pytest.raises(DatumError, match=r"\['wieghts'\]: .*did you mean 'weights'\?"):
        tiny_backend.forward(typo, "cross_entropy")  # a key no loss reads: refused by forward too


def test_ref_logprobs_without_kl_coef_says_to_set_kl_coef(tiny_backend):
    data = with_ref_logprobs(rl_datums(), tiny_backend.forward(rl_datums(), "cross_entropy"))
    with pytest.raises(DatumError) as info:
        tiny_backend.forward_backward(data, "ppo")
    message = str(info.value)
    assert "ref_logprobs" in message and "kl_coef > 0" in message and "did you mean" not in message
    out = tiny_backend.forward_backward(data, "ppo", {"kl_coef": 0.1, "loss_reduction": "token_mean"})
    assert out.metrics["kl_loss:sum"] == 0.0  # the reference is this very model: no divergence yet


def test_with_ref_logprobs_checks_it_got_the_output_of_these_datums(tiny_backend):
    data = rl_datums()
    ref = tiny_backend.forward(data, "cross_entropy")
    added = with_ref_logprobs(data, ref)
    for d, o in zip(added, ref.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(d.loss_fn_inputs["ref_logprobs"].to_numpy(), o["logprobs"].to_numpy())
    with pytest.raises(InputError, match="expected the output of forward on these 2 datums, got 1"):
        with_ref_logprobs(data, tiny_backend.forward(data[:1], "cross_entropy"))
    with pytest.raises(InputError, match=r"reference output 0: expected logprobs of shape \[6\]"):
        with_ref_logprobs(data, tiny_backend.forward(data[::-1], "cross_entropy"))


# ---- docs/skyrl-parity.md: PPO with token_mean and a KL term ----------------------------------------------
@pytest.mark.slow
def test_parity_ppo_kl_block_runs_as_written(capsys):
    block = python_blocks((DOCS / "skyrl-parity.md").read_text())[0]
    exec(compile(block, "skyrl-parity.md", "exec"), {})
    lines = re.findall(r"^step (\d): mean reward ([.\d]+)  kl_loss ([.\d]+)$", capsys.readouterr().out, re.M)
    assert [int(s) for s, _, _ in lines] == [0, 1, 2]
    kl = [float(k) for _, _, k in lines]
    assert kl[0] == 0.0 and kl[1] > 0 and kl[2] > 0  # the doc: 0 at first, then the policy moves


# ---- docs/server.md: the tinker client's close ------------------------------------------------------------
def test_server_doc_closes_sessions_the_way_the_installed_tinker_takes():
    tinker = pytest.importorskip("tinker")
    text = (DOCS / "server.md").read_text()
    calls = re.findall(r"close\(([^)]*)\)", text)
    assert calls and "ServiceClient.close()" not in text
    signature = inspect.signature(tinker.ServiceClient.close)
    for args in calls:
        signature.bind(None, *eval(f"({args},)") if args else ())  # the doc's literals


def test_server_doc_says_what_the_tinker_client_drops_or_converts_before_sending():
    """docs/server.md: the installed client drops an unknown SamplingParams key and turns a list
    of fractional target_tokens into int64 before a request leaves it; in process (and in a raw
    request) both are refused by name. If the client changes, this fails and the doc is rewritten."""
    tt = pytest.importorskip("tinker").types
    import numpy as np

    from skyrl_sdk import types
    from skyrl_sdk.errors import InputError
    from skyrl_sdk.inputs.coerce import data_from_any

    text = " ".join((DOCS / "server.md").read_text().split())
    assert "`tinker.types.SamplingParams(temprature=0.5)` drops the unknown key" in text
    assert "truncating to `[5, 6]`" in text
    params = tt.SamplingParams(max_tokens=4, temprature=0.5)
    assert "temprature" not in params.model_dump() and params.temperature == 1
    sent = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [5.5, 6.7]})
    assert sent.loss_fn_inputs["target_tokens"].to_numpy().tolist() == [5, 6]
    floats = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2]),
                      loss_fn_inputs={"target_tokens": np.array([5.5, 6.7])})
    with pytest.raises(InputError, match="target_tokens"):
        data_from_any([floats])  # what the server gets from the numpy form: refused
    with pytest.raises(InputError, match="expected integer token ids, got fractional values"):
        types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [5.5, 6.7]})
