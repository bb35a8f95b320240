"""``skyrl-sdk losses`` says what each loss accepts, and it is true: for every registered loss
(plugins included), in every dialect, by every name that dialect calls it:

- the config keys it lists are accepted (with the defaults it lists), and every other loss's
  keys, native or Tinker's, are refused as unknown;
- a datum with exactly the required inputs trains; leaving one out is refused naming it; each
  optional input is accepted; each never-send input is refused.

Before the listing came from each loss's contract, stable_reinforce listed ``logprobs`` and
``sampled_mask`` as required (a datum must never send ``sampled_mask``), and ``--dialect
tinker`` listed native keys (``eps_clip_low``) under Tinker's ``ppo``, which refuses them."""

from __future__ import annotations

import numpy as np
import pytest

from skyrl_sdk import Backend, builtin_plugins, types
from skyrl_sdk.cli.losses import loss_rows
from skyrl_sdk.errors import DatumError, LossConfigError
from skyrl_sdk.rl import datum_from_sample

PROMPT = [1, 5, 6, 7]


@pytest.fixture(scope="module")
def rows():
    builtin_plugins.reset()
    return loss_rows()


@pytest.fixture(scope="module")
def backends():
    with Backend(model="tiny", seed=0) as policy, Backend(model="tiny", role="critic", seed=0) as critic:
        yield {"policy": policy, "critic": critic}


def _every_key(rows) -> set[str]:
    keys = set()
    for row in rows:
        keys |= set(row["config"])
        for by_name in row["config_by_name"].values():
            for listed in by_name.values():
                keys |= set(listed)
    return keys


def test_every_listed_config_is_accepted_and_every_other_key_refused(rows):
    registry = builtin_plugins.get_registry()
    every = _every_key(rows)
    checked = 0
    for row in rows:
        for dialect, by_name in row["config_by_name"].items():
            assert set(by_name) == set(row["dialect_names"][dialect])
            for name, listed in by_name.items():
                resolved = registry.resolve(name, listed, dialect=dialect, role=row["role"])
                assert resolved.spec.name == row["name"], (dialect, name)
                for key in sorted(every - set(listed) - set(row["shared_config_keys"])):
                    with pytest.raises(LossConfigError, match=rf"unknown loss_fn_config key '{key}'|takes no "):
                        registry.resolve(name, {key: 1.0}, dialect=dialect, role=row["role"])
                    checked += 1
    assert checked > 100


def test_stable_reinforce_and_tinker_ppo_as_the_listing_gives_them(rows):
    by = {r["name"]: r for r in rows}
    stable = by["stable_reinforce"]
    assert stable["required_inputs"] == ["target_tokens", "advantages"]
    assert set(stable["optional_inputs"]) == {"weights", "logprobs"} and stable["never_send_inputs"] == ["sampled_mask"]
    assert stable["config_by_name"]["tinker"] == {"stable_reinforce": {"kl_coeff": 0.0, "ratio_cap": 2.0}}
    ppo = by["regular"]["config_by_name"]["tinker"]
    assert ppo == {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                   "regular": {"eps_clip_low": 0.2, "eps_clip_high": 0.2}}
    assert by["cispo"]["config_by_name"]["tinker"]["cispo"] == {"clip_low_threshold": 0.0, "clip_high_threshold": 5.0}


def _value(key: str, n: int, base: types.Datum | None):
    """A valid value of input ``key`` for a datum of ``n`` positions (``base``'s when it has it)."""
    if base is not None and key in base.loss_fn_inputs:
        return base.loss_fn_inputs[key].to_numpy()
    return {"target_tokens": np.arange(2, 2 + n, dtype=np.int64), "advantages": np.linspace(-1, 1, n),
            "logprobs": np.full(n, -2.0), "weights": np.ones(n), "clip_low_threshold": np.full(n, 0.8),
            "clip_high_threshold": np.full(n, 1.2), "values": np.linspace(0, 1, n), "returns": np.ones(n),
            "sampled_mask": np.ones(n)}.get(key, np.zeros(n))


def _datum(keys, base: types.Datum | None) -> types.Datum:
    model_input = base.model_input if base is not None else types.ModelInput.from_ints(PROMPT + [8, 9])
    n = model_input.length
    datum = types.Datum(model_input=model_input,
                        loss_fn_inputs={k: np.asarray(_value(k, n, base), dtype=np.int64 if k == "target_tokens"
                                                      else np.float32) for k in keys})
    if base is not None and base.model_input_spans is not None:
        datum = datum.with_provenance(model_input=base.model_input_spans, loss_fn_inputs=base.loss_fn_input_spans)
    return datum


@pytest.mark.slow
def test_every_loss_trains_on_its_required_inputs_and_refuses_what_the_listing_says(rows, backends):
    policy = backends["policy"]
    out = policy.sample([PROMPT], {"max_tokens": 3, "seed": 1, "stop": []}, record_stability_info=True)
    recorded = datum_from_sample(PROMPT, out[0].sequences[0], 1.0)
    for row in rows:
        backend = backends[row["role"]]
        name = row["dialect_names"]["tinker"][0]
        base = recorded if row["needs_provenance"] else None
        required = row["required_inputs"]
        backend.forward_backward([_datum(required, base)], name)
        for key in required:
            with pytest.raises(DatumError, match=key):
                backend.forward_backward([_datum([k for k in required if k != key], base)], name)
        for key in row["optional_inputs"]:
            backend.forward_backward([_datum(required + [key], base)], name)
        for key in row["never_send_inputs"]:
            with pytest.raises(DatumError, match=key):
                backend.forward_backward([_datum(required + [key], base)], name)
        backend.zero_grad()
