"""The micro-batch loop never waits for the device between micro-batches: per-token outputs and
metrics stay on the device until the call's last micro-batch, then come back in one transfer per
output name (on CUDA a ``.cpu()``, ``.item()`` or ``float(tensor)`` blocks the host until the GPU
has finished everything queued, so one per micro-batch starves the GPU of queued work).

On CPU there is no device queue, so this counts the operations of ours (the runner, the losses,
the metrics) that would wait on CUDA: their number must not grow with the number of micro-batches.
(transformers' own mask preparation still reads one boolean per forward: whether the position
ids describe packed sequences, ``masking_utils.find_packed_sequence_indices``.)"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.testing import count_micro_batches, prepared_call

WAITING = ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__")
OURS = Path(skyrl_sdk.__file__).resolve().parent


@contextlib.contextmanager
def count_host_reads():
    """How many times each tensor operation that reads a value back to the host ran, called from
    our code."""
    counts = dict.fromkeys(WAITING, 0)
    originals = {name: getattr(torch.Tensor, name) for name in WAITING}

    def counting(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            caller = inspect.currentframe().f_back
            if Path(caller.f_code.co_filename).resolve().is_relative_to(OURS):
                counts[name] += 1
            return original(self, *args, **kwargs)
        return read

    for name in WAITING:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _data(n, loss):
    rng = np.random.default_rng(n)
    out = []
    for _ in range(n):
        inputs = {"target_tokens": rng.integers(3, 300, 12).tolist()}
        if loss != "cross_entropy":
            inputs.update(logprobs=(-rng.random(12)).astype(np.float32), advantages=rng.normal(size=12).astype(np.float32))
        out.append(types.Datum(model_input=types.ModelInput.from_ints(rng.integers(3, 300, 12).tolist()),
                               loss_fn_inputs=inputs))
    return out


@pytest.mark.parametrize(("loss", "config"), [("cross_entropy", None), ("ppo", {"kl_coef": 0.0}),
                                              ("ppo", {"loss_reduction": "token_mean"})])
def test_host_reads_do_not_grow_with_micro_batches(loss, config):
    counts = {}
    # one datum per micro-batch (12 tokens each): 2 and then 8 micro-batches, the same work per one
    with skyrl_sdk.Backend(model="tiny", engine_config={"micro_batch_tokens": 12, "prefix_sharing": False}) as b:
        b.forward_backward(_data(1, loss), loss, config)  # warm-up: lazy initializations read values once
        for n in (2, 8):
            with count_micro_batches() as boundaries, count_host_reads() as reads:
                b.engine.run(*_prepared(b, _data(n, loss), loss, config), backward=True)
            assert boundaries[0] == n - 1  # n micro-batches
            counts[n] = dict(reads)
    assert counts[8] == counts[2], counts


def _prepared(b, data, loss, config):
    return prepared_call(b, data, loss, config)
