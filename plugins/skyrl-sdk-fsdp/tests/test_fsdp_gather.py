"""Full checkpoints are gathered to rank 0 only (``gather.gathered``): rank 0 gets each full tensor,
exactly, in host memory; the other ranks get nothing (they used to all-gather and copy every tensor
to the CPU as well). And ``cpu_offload`` (FSDP2's ``CPUOffloadPolicy``) trains as without it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from fsdp_testutil import HANG_S, LENGTHS, ONE_PER_MICRO_BATCH

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.testing import make_sft_data

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from skyrl_sdk_fsdp.gather import gathered

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for rows in (5, 6, 1):  # uneven, even, fewer rows than ranks
        full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 0.5
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        got = gathered(sharded, rank)
        results[f"shard{rows}"] = None if got is None else [got.tolist(), got.device.type, list(got.shape)]
    replicated = distribute_tensor(torch.ones(2, 2), mesh, [Replicate()])
    got = gathered(replicated, rank)
    results["replicated"] = None if got is None else got.tolist()
    got = gathered(torch.full((2,), 7.0), rank)
    results["plain"] = None if got is None else got.tolist()
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_only_rank_0_gets_the_full_tensors(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port, world = _free_port(), 3
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port), str(tmp_path / "out")],
                              env=env) for r in range(world)]
    for p in procs:
        assert p.wait(timeout=HANG_S) == 0
    results = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(world)]
    for rows in (5, 6, 1):
        values, device, shape = results[0][f"shard{rows}"]
        np.testing.assert_array_equal(values, np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 0.5)
        assert device == "cpu" and shape == [rows, 3]
    assert results[0]["replicated"] == [[1.0, 1.0], [1.0, 1.0]] and results[0]["plain"] == [7.0, 7.0]
    for other in results[1:]:
        assert all(v is None for v in other.values()), other  # nothing gathered, nothing copied


def _train_steps(backend, steps=2):
    data = make_sft_data(LENGTHS, seed=3)
    out = []
    for _ in range(steps):
        out.append(backend.forward_backward(data, "cross_entropy").metrics["loss:sum"])
        backend.optim_step(types.AdamParams(learning_rate=1e-2))
    return out


@pytest.mark.slow
def test_cpu_offload_trains_and_saves_as_without_it(tmp_path):
    config = {**ONE_PER_MICRO_BATCH, "world_size": 2}
    with skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={**config, "cpu_offload": True}) as off, \
            skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config=config) as on:
        np.testing.assert_allclose(_train_steps(off), _train_steps(on), rtol=1e-6)
        off.save_state(tmp_path / "off")
        on.save_state(tmp_path / "on")
    from safetensors.numpy import load_file

    a, b = load_file(str(tmp_path / "off" / "model.safetensors")), load_file(str(tmp_path / "on" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-6, err_msg=k)


def test_cpu_offload_is_a_bool():
    with pytest.raises(errors.InputError, match=r"engine_config\['cpu_offload'\]: expected true or false, got 'yes'"):
        skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"cpu_offload": "yes", "world_size": 2})
