"""What a user reads: errors name the loss as typed and suggest the close name for a typo;
our own noise (a deprecation inside peft, progress bars for tiny loads) is silenced, theirs is not."""

from __future__ import annotations

import warnings

import pytest
import torch

from skyrl_sdk.errors import (
    DatumError,
    InputError,
    LossConfigError,
    UnknownLossError,
    UnknownNameError,
    did_you_mean,
)
from skyrl_sdk.evaluate import evaluate_loss
from skyrl_sdk.inputs import coerce

LP = torch.zeros(3)


def test_did_you_mean_only_for_a_close_name():
    assert did_you_mean("ppoo", ["ppo", "cispo"]) == "; did you mean 'ppo'?"
    assert did_you_mean("zzzz", ["ppo", "cispo"]) == ""
    assert did_you_mean(None, ["ppo"]) == "" and did_you_mean("", ["ppo"]) == ""


def test_a_name_typed_in_capitals_gets_the_lower_case_name():
    """Names compare case-insensitively; the suggestion is the name as registered."""
    assert did_you_mean("PPO", ["ppo", "cispo"]) == "; did you mean 'ppo'?"
    assert did_you_mean("Cross_Entropy", ["cross_entropy"]) == "; did you mean 'cross_entropy'?"
    with pytest.raises(UnknownLossError) as exc:
        evaluate_loss("PPO", LP, {}, dialect="tinker")
    assert str(exc.value).endswith("; did you mean 'ppo'?"), str(exc.value)
    with pytest.raises(InputError) as exc:
        coerce.adam_params_from_any({"Learning_Rate": 1e-3})
    assert str(exc.value).endswith("; did you mean 'learning_rate'?"), str(exc.value)


def test_missing_input_names_the_typed_loss_and_the_canonical_one():
    with pytest.raises(DatumError) as exc:
        evaluate_loss("ppo", LP, {"logprobs": LP}, dialect="tinker")
    assert "loss 'ppo' (native 'regular') requires input 'advantages'" in str(exc.value)
    with pytest.raises(DatumError) as exc:  # the canonical name typed: named once
        evaluate_loss("regular", LP, {"logprobs": LP}, dialect="native")
    assert "loss 'regular' requires input 'advantages'" in str(exc.value)


@pytest.mark.parametrize(
    "call, error, expected",
    [
        (dict(name="ppoo", inputs={}, dialect="tinker"), UnknownLossError,
         "unknown loss_fn 'ppoo' (dialect 'tinker'); available: ["),
        (dict(name="ppo", inputs={}, dialect="tinkr"), UnknownNameError, "unknown dialect 'tinkr'"),
        (dict(name="ppo", inputs={}, dialect="tinker", config={"clip_low_treshold": 0.8}), LossConfigError,
         "unknown loss_fn_config key 'clip_low_treshold'"),
        (dict(name="cispo", inputs={}, dialect="native", config={"cispo_eps_clip_lo": 1.0}), LossConfigError,
         "loss 'cispo': unknown loss_fn_config key 'cispo_eps_clip_lo'"),
        (dict(name="ppo", inputs={"logprobs": LP, "advantages": LP, "advantage": LP}, dialect="tinker"),
         DatumError, "loss 'ppo' (native 'regular') does not take this input"),
    ],
)
def test_typos_get_a_suggestion(call, error, expected):
    suggestion = {"ppoo": "ppo", "tinkr": "tinker", "clip_low_treshold": "clip_low_threshold",
                  "cispo_eps_clip_lo": "cispo_eps_clip_low", "advantage": "advantages"}
    with pytest.raises(error) as exc:
        evaluate_loss(call["name"], LP, call["inputs"], call.get("config"), dialect=call["dialect"])
    message = str(exc.value)
    assert expected in message
    typo = next(t for t in suggestion if repr(t) in message)
    assert message.endswith(f"did you mean {suggestion[typo]!r}?"), message


def test_no_suggestion_when_nothing_is_close():
    with pytest.raises(UnknownLossError) as exc:
        evaluate_loss("xyzzy_quux", LP, {}, dialect="tinker")
    assert "did you mean" not in str(exc.value)


@pytest.mark.parametrize(
    "build, field, typo, close",
    [
        (lambda: _engine_config({"devcie": "cpu"}), "engine_config: unknown key", "devcie", "device"),
        (lambda: _engine("locl"), "unknown engine", "locl", "local"),
        (lambda: _model("tny"), "model", "tny", "tiny"),
        (lambda: coerce.adam_params_from_any({"learning_rat": 1e-3}), "AdamParams: unknown keys",
         "learning_rat", "learning_rate"),
        (lambda: coerce.lora_config_from_any({"rnak": 4}), "LoraConfig: unknown keys", "rnak", "rank"),
        (lambda: coerce.sampling_params_from_any({"max_token": 4}), "SamplingParams: unknown keys",
         "max_token", "max_tokens"),
    ],
)
def test_misspelt_names_and_keys_get_a_suggestion(build, field, typo, close):
    with pytest.raises(InputError) as exc:
        build()
    message = str(exc.value)
    assert message.startswith(field) and repr(typo) in message, message
    assert message.endswith(f"; did you mean {close!r}?"), message


def test_each_close_key_is_suggested_and_a_far_one_is_not():
    with pytest.raises(InputError) as exc:
        coerce.adam_params_from_any({"learning_rat": 1e-3, "bta1": 0.9, "zzz": 1})
    assert str(exc.value).endswith("; did you mean 'beta1' for 'bta1', 'learning_rate' for 'learning_rat'?")
    for build in (lambda: coerce.adam_params_from_any({"zzz": 1}), lambda: _engine_config({"zzzzz": 1}),
                  lambda: _model("/no/such/model")):
        with pytest.raises(InputError) as exc:
            build()
        assert "did you mean" not in str(exc.value)


def _engine_config(cfg):
    from skyrl_sdk import Backend

    return Backend(engine_config=cfg)  # the same check serves `skyrl-sdk serve --engine-config`


def _engine(name):
    from skyrl_sdk import get_registry

    return get_registry().engine_spec(name)  # what `skyrl-sdk serve --engine` asks


def _model(name):
    from skyrl_sdk import Backend

    return Backend(model=name)


def test_backend_suggests_the_close_engine_dialect_and_sampler():
    from skyrl_sdk import Backend

    with pytest.raises(UnknownNameError, match=r"unknown engine 'locl'.*did you mean 'local'\?"):
        Backend(engine="locl")
    with pytest.raises(UnknownNameError, match=r"unknown dialect 'tinkr'.*did you mean 'tinker'\?"):
        Backend(dialect="tinkr")
    with pytest.raises(UnknownNameError, match=r"unknown sampler 'transformer'.*did you mean 'transformers'\?"):
        Backend(sampler="transformer")


def test_our_noise_is_silenced_and_the_users_warnings_are_not(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    from skyrl_sdk import SharedBase, types
    from skyrl_sdk.models.loading import load_model

    load_model("tiny").module.save_pretrained(tmp_path)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model(str(tmp_path), lora=types.LoraConfig(rank=2))
        with SharedBase("tiny") as base, base.backend(types.LoraConfig(rank=2)):  # the server's LoRA path
            pass
        warnings.warn("the user's own deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["the user's own deprecation"]
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # the user's setting is restored


def test_server_adam_params_suggest_the_close_key_in_the_in_process_words():
    from skyrl_sdk.server.wire.envelopes import parse_adam_params

    for fields in ({"learning_rat": 1e-4}, {"bta1": 0.9, "bta2": 0.99}):
        with pytest.raises(InputError) as in_process:
            coerce.adam_params_from_any(fields)
        with pytest.raises(InputError) as over_http:
            parse_adam_params({"adam_params": fields})
        assert str(over_http.value) == str(in_process.value)
    assert "unknown keys ['learning_rat']" in str(_raised(coerce.adam_params_from_any, {"learning_rat": 1e-4}))
    assert "did you mean 'beta1' for 'bta1', 'beta2' for 'bta2'?" in str(
        _raised(parse_adam_params, {"adam_params": {"bta1": 0.9, "bta2": 0.99}}))


def _raised(fn, *args) -> InputError:
    with pytest.raises(InputError) as caught:
        fn(*args)
    return caught.value


def test_a_missing_ref_logprobs_says_how_to_get_them():
    """kl_coef > 0 without ref_logprobs: the message names the reference forward and
    rl.with_ref_logprobs, and doing what it says makes the call go through."""
    from skyrl_sdk import Backend, rl, types

    data = [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [-1.0] * 3, "advantages": [1.0] * 3})]
    with Backend(model="tiny", seed=0) as policy:
        with pytest.raises(DatumError) as exc:
            policy.forward_backward(data, "ppo", {"kl_coef": 0.05})
        message = str(exc.value)
        assert message.startswith("datum 0: loss 'ppo' (native 'regular') requires input 'ref_logprobs'"), message
        for advice in ("reference.forward(data, 'cross_entropy')", "skyrl_sdk.rl.with_ref_logprobs(data, ref)",
                       "kl_coef 0"):
            assert advice in message, message
        reference = policy  # untrained: the same weights (the advice's calls, as written)
        ref = reference.forward(data, "cross_entropy")
        out = policy.forward_backward(rl.with_ref_logprobs(data, ref), "ppo", {"kl_coef": 0.05})
        assert out.metrics["kl_loss:sum"] == pytest.approx(0.0, abs=1e-6)  # the reference is the policy itself


@pytest.mark.parametrize("dialect", ["tinker", "native"])
def test_kl_coef_sent_to_stable_reinforce_suggests_its_own_kl_coeff(dialect):
    """``kl_coef`` is every loss's KL term to a reference model (it needs ``ref_logprobs``);
    stable_reinforce's own key is ``kl_coeff``. The missing-input error says which was meant,
    and lists the inputs a caller sends (not ``sampled_mask``, which provenance writes)."""
    from skyrl_sdk import Backend
    from skyrl_sdk.rl import datum_from_sample

    with Backend(model="tiny", seed=0, dialect=dialect) as backend:
        out = backend.sample([[1, 5, 6]], {"max_tokens": 3, "stop": [], "seed": 0}, record_stability_info=True)
        data = [datum_from_sample([1, 5, 6], out[0].sequences[0], 1.0)]
        with pytest.raises(DatumError) as exc:
            backend.forward_backward(data, "stable_reinforce", {"kl_coef": 0.1})
        message = str(exc.value)
        assert "requires input 'ref_logprobs' (required: ['target_tokens', 'advantages', 'ref_logprobs'])" in message
        assert "did you mean this loss's own 'kl_coeff'?" in message and "sampled_mask" not in message
        assert backend.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.1}).metrics["loss:sum"] != 0
        # a loss without a close key of its own gets no such guess
        with pytest.raises(DatumError) as exc:
            backend.forward_backward(data, "importance_sampling", {"kl_coef": 0.1})
        assert "did you mean" not in str(exc.value)


def test_install_hints_name_the_checkout_and_doctor_never_a_package_on_no_index():
    """None of skyrl-sdk's packages is on a package index: a hint to ``pip install skyrl-sdk-fsdp``
    or ``'skyrl-sdk-vllm[gpu]'`` failed for a newcomer. Every string in the code that tells a
    user to pip install one of ours installs it from the checkout (``-e``), and the hints point
    at ``skyrl-sdk doctor``."""
    import ast
    import re
    from pathlib import Path

    from skyrl_sdk.errors import INSTALL_COMMANDS, install_hint

    root = Path(__file__).resolve().parents[1]
    ours = re.compile(r"pip install\s+(?!-e\b)['\"]?skyrl-sdk")
    bad = []
    for path in [*root.glob("src/skyrl_sdk/**/*.py"), *root.glob("plugins/*/src/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ours.search(node.value):
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {node.value[:80]!r}")
    assert not bad, bad
    for piece, command in INSTALL_COMMANDS.items():
        assert command.startswith("pip install -e "), piece
        assert install_hint(piece).endswith("(in the skyrl-sdk checkout; `skyrl-sdk doctor` checks the environment)")


def test_a_missing_plugin_names_its_folder_and_doctor():
    from skyrl_sdk import Backend

    with pytest.raises(UnknownNameError) as exc:
        Backend(model="tiny", sampler="vllm")
    message = str(exc.value)
    assert 'pip install -e ".[lora,server]" -e "plugins/skyrl-sdk-vllm[gpu]"' in message and "skyrl-sdk doctor" in message
