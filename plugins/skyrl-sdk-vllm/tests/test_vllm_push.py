"""The gloo weight-transfer backend's wire (buckets, each trainer rank's rows, reassembly) and the
pushed engine in this process: bit-exact transfers, logprobs equal ``forward`` after steps, and
placement settings refused by name."""

from __future__ import annotations

import datetime
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from vllm_testutil import HANG_S, SMALL, forward_logprobs, train

import skyrl_sdk
from skyrl_sdk.errors import InputError
from skyrl_sdk.plugins.weight_push import PushLayout, PushTarget, TensorSlices, local_slice, push_slices
from skyrl_sdk_vllm import transfer
from skyrl_sdk_vllm.placement import PlacementConfig

PROMPT = list(range(5, 40))


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(13, 8, generator=g), "norm": torch.randn(8, generator=g).to(torch.bfloat16),
            "ids": torch.arange(7, dtype=torch.int64), "scale": torch.tensor(2.5), "head": torch.randn(5, 3, generator=g)}


def _layout(tensors, ranks=2) -> PushLayout:
    """FSDP2's rows: ceil(n / ranks) per rank, the last ones short or empty; 0-d on rank 0."""
    specs = []
    for name, t in tensors.items():
        if t.dim() == 0:
            rows = ((0, 1),) + ((0, 0),) * (ranks - 1)
        else:
            n, chunk = t.shape[0], -(-t.shape[0] // ranks)
            rows = tuple((min(r * chunk, n), min((r + 1) * chunk, n)) for r in range(ranks))
        dtype = "float32" if t.dtype == torch.float32 else str(t.dtype).removeprefix("torch.")
        specs.append(TensorSlices(name=name, dtype=dtype, shape=tuple(t.shape), rows=rows))
    return PushLayout(ranks=ranks, tensors=tuple(specs))


def test_a_layout_must_cover_each_tensor_once():
    with pytest.raises(ValueError, match="do not cover"):
        PushLayout(ranks=2, tensors=(TensorSlices("w", "float32", (4, 2), ((0, 3), (2, 4))),))
    with pytest.raises(ValueError, match="rows for 1 ranks"):
        PushLayout(ranks=2, tensors=(TensorSlices("w", "float32", (4, 2), ((0, 4),)),))
    layout = _layout(_tensors(), ranks=3)
    assert PushLayout.from_plain(layout.to_plain()) == layout


@pytest.mark.parametrize("bucket_bytes", [1, 64, 2**20])
def test_each_rank_packs_its_rows_and_a_worker_reassembles_every_tensor(bucket_bytes):
    tensors = _tensors()
    layout = _layout(tensors)
    groups = transfer.buckets(layout, bucket_bytes)
    assert [i for g in groups for i in g] == list(range(len(tensors)))
    for indices in groups:
        buffers = []
        for rank in range(2):
            slices = [local_slice(tensors[layout.tensors[i].name], layout.tensors[i].rows[rank], layout.tensors[i].dtype)
                      for i in indices]
            buffers.append(transfer.pack(slices))
            assert buffers[-1].numel() == transfer.packed_bytes(layout, indices, rank)
        per_rank = [transfer.unpack(b, layout, indices, r) for r, b in enumerate(buffers)]
        for k, i in enumerate(indices):
            whole = transfer.assemble(layout, i, [per_rank[0][k], per_rank[1][k]])
            torch.testing.assert_close(whole, tensors[layout.tensors[i].name], rtol=0, atol=0)


def test_two_trainer_ranks_push_to_two_engines_over_gloo_bit_exactly():
    """Two sender threads (the trainer's ranks, each with its own rows) and two groups of one worker."""
    tensors = _tensors()
    layout = _layout(tensors)
    timeout = datetime.timedelta(seconds=60)
    stores = [dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False) for _ in range(2)]
    groups = [{"host": "127.0.0.1", "port": s.port, "prefix": f"t/{i}/", "world_size": 3} for i, s in enumerate(stores)]
    got: dict[int, dict[str, torch.Tensor]] = {}
    errors = []

    def worker(index: int) -> None:
        try:
            pg = transfer.open_group("127.0.0.1", stores[index].port, f"t/{index}/", 2, 3, 60)
            got[index] = {n: t.clone() for pairs in transfer.receive(pg, layout, 2, 64) for n, t in pairs}
        except Exception as exc:
            errors.append(exc)

    def trainer(rank: int) -> None:
        try:
            target = PushTarget(sender="skyrl_sdk_vllm.transfer:GlooSender", key=f"test-{rank}",
                                options={"groups": groups, "trainer_ranks": 2, "timeout_s": 60, "bucket_bytes": 64})
            push_slices(target, rank, layout, (local_slice(tensors[t.name], t.rows[rank], t.dtype)
                                               for t in layout.tensors))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=trainer, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not errors, errors
    for index in range(2):
        assert got[index].keys() == tensors.keys()
        for name, t in tensors.items():
            torch.testing.assert_close(got[index][name], t, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, {"rank": 4}], ids=["full", "lora"])
def test_the_local_engine_pushes_through_gloo_into_an_engine_in_this_process(lora):
    with skyrl_sdk.Backend(model="tiny", lora=lora, sampler="vllm", sampler_config={**SMALL, "transfer": "gloo"}) as b:
        for step in range(3):
            s = b.sample([PROMPT], {"max_tokens": 8, "seed": step})[0].sequences[0]
            np.testing.assert_allclose(s.logprobs, forward_logprobs(b, PROMPT, s.tokens), atol=1e-3)
            train(b, steps=1)
        assert "vllm engine 0 (in this process); weights pushed: gloo" in b.sampler.describe()
        assert b.sampler.last_sync["version"] == b.sampler.source.version - 1  # synced before the last step


@pytest.mark.parametrize("config, message", [
    ({"engines": 2}, r"sampler_config\['engines'\] needs placement 'ray'"),
    ({"placement": "ray", "colocate": True, "tensor_parallel_size": 2}, "tensor_parallel_size 1"),
    ({"placement": "elsewhere"}, r"sampler_config\['placement'\]: expected one of \['local', 'ray'\]"),
    ({"placement": "ray", "engines": 0}, r"sampler_config\['engines'\]"),
    ({"transfer": "smoke-signals"}, r"sampler_config\['transfer'\]"),
])
def test_placement_settings_are_checked_by_name(config, message):
    with pytest.raises(InputError, match=message):
        PlacementConfig.split(config)


def test_pushed_engines_refuse_what_they_cannot_do():
    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config={**SMALL, "transfer": "nccl"}) as b:
        with pytest.raises(InputError, match="'nccl' needs the engines on GPUs of their own"):
            b.sample([PROMPT], {"max_tokens": 1})
