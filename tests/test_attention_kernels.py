"""``engine_config["attn_implementation"]``: the kernels offered, eager against sdpa, refusals by
name (a kernel that cannot run here; prefix sharing on a kernel it does not run on), and the
device decision as a pure function (its CUDA branch checked without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.engines import EngineConfig
from skyrl_sdk.models import attention, prefix_attention
from skyrl_sdk.models.loading import load_model
from skyrl_sdk.testing import grads_of


def _data():
    rng = np.random.default_rng(0)
    out = []
    for n in (17, 40, 9, 23):
        ids = rng.integers(3, 300, n + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}))
    return out


def _logprobs_and_grads(engine_config):
    with skyrl_sdk.Backend(model="tiny", engine_config=engine_config) as b:
        out = b.forward_backward(_data(), "cross_entropy")
        lps = np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
        return lps, grads_of(b), b.engine.loaded.module.config._attn_implementation


@pytest.mark.parametrize("batching", ["bucket", "pack"])
def test_eager_equals_sdpa_within_1e_5(batching):
    base = {"batching": batching, "prefix_sharing": False, "micro_batch_tokens": 64}
    sdpa, sdpa_grads, sdpa_impl = _logprobs_and_grads({**base, "attn_implementation": "sdpa"})
    eager, eager_grads, eager_impl = _logprobs_and_grads({**base, "attn_implementation": "eager"})
    assert (sdpa_impl, eager_impl) == ("sdpa", "eager")  # each model really runs its kernel
    np.testing.assert_allclose(eager, sdpa, atol=1e-5, rtol=0)
    assert sdpa_grads.keys() == eager_grads.keys()
    for name, g in sdpa_grads.items():
        np.testing.assert_allclose(eager_grads[name], g, atol=1e-5, rtol=1e-4, err_msg=name)


def test_the_default_kernel_is_sdpa():
    """Unset, transformers picks: sdpa for every family that has it (eager for Gemma2)."""
    assert EngineConfig().attn_implementation is None
    with skyrl_sdk.Backend(model="tiny") as b:
        assert b.engine.loaded.module.config._attn_implementation.endswith("sdpa")  # (prefix sharing's own sdpa)


def test_flash_attention_is_refused_by_name_on_cpu():
    with pytest.raises(errors.InputError, match=r"engine_config\['attn_implementation'\]: 'flash_attention_2' runs "
                                                r"on CUDA only"):
        skyrl_sdk.Backend(model="tiny", engine_config={"attn_implementation": "flash_attention_2", "device": "cpu"})


def test_an_unknown_kernel_is_refused_with_the_ones_offered():
    with pytest.raises(errors.InputError, match=r"attn_implementation.*'sdpa', 'eager', 'flash_attention_2'.*"
                                                r"got 'flash'"):
        skyrl_sdk.Backend(model="tiny", engine_config={"attn_implementation": "flash"})


@pytest.mark.parametrize(("name", "device", "installed", "reason"), [
    ("flash_attention_2", "cuda", True, None),
    ("flash_attention_2", "cuda", False, "needs pip install flash-attn"),
    ("flash_attention_2", "cpu", True, "runs on CUDA only"),
    ("flash_attention_3", "cuda", False, "needs flash-attn 3"),
    ("flex_attention", "cpu", True, "no FlexAttention backward on cpu"),
    ("flex_attention", "cuda", True, None),
    ("sdpa", "cuda", False, None),
    ("eager", "cpu", False, None),
])
def test_availability_is_a_function_of_the_device_and_the_package(name, device, installed, reason):
    got = attention.unavailable_reason(name, device, is_installed=lambda kernel: installed)
    assert (got is None) == (reason is None) and (reason is None or reason in got), got


def test_prefix_sharing_says_which_kernels_it_runs_on():
    # asked for on a kernel it does not run on: refused by name (before any model is loaded)
    for kernel in ("flash_attention_2", "flash_attention_3", "flex_attention"):
        with pytest.raises(errors.InputError, match=r"engine_config\['prefix_sharing'\]: prefix sharing runs on the "
                                                    r"\['sdpa', 'eager'\] attention kernels, not "
                                                    rf"attn_implementation='{kernel}'"):
            EngineConfig.from_mapping({"attn_implementation": kernel, "prefix_sharing": True})
        # left at its default it is off there, and the runner's status says why
        assert EngineConfig.from_mapping({"attn_implementation": kernel}).prefix_sharing is None
    model = load_model("tiny", attn_implementation="eager").module
    model.config._attn_implementation = "flash_attention_2"  # what a CUDA machine would have loaded
    assert prefix_attention.unsupported_reason(model) == ("attention implementation 'flash_attention_2' (shared "
                                                          "rows need 'sdpa' or 'eager')")
    for kernel in attention.PREFIX_SHARING_KERNELS:
        with skyrl_sdk.Backend(model="tiny", engine_config={"attn_implementation": kernel}) as b:
            assert b.get_info().prefix_sharing.startswith(f"on: two-part attention over {kernel}")


def test_packed_rows_are_varlen_on_the_flash_kernels():
    for kernel in ("flash_attention_2", "flash_attention_3"):
        assert attention.PACKED_ROWS[kernel].startswith("varlen")
    assert set(attention.PACKED_ROWS) == set(attention.ATTN_IMPLEMENTATIONS)
