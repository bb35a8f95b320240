"""Per-rank memory of parameters, gradients and AdamW state: fsdp (N ranks) vs the local engine.

Counts the bytes of the tensors each rank holds (its local shards for fsdp), after one
forward_backward (gradients) and one optim_step (optimizer moments). Prints JSON.

    python plugins/skyrl-sdk-fsdp/scripts/fsdp_memory.py            # tiny + a ~10M llama
    python plugins/skyrl-sdk-fsdp/scripts/fsdp_memory.py --world-size 2 --models tiny

The ~10M model is a random-weight Llama written to a temporary HF directory (no hub).
RSS is the whole process (torch itself is a few hundred MB), given for context only.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np


def make_llama_dir(path: str) -> str:
    """A ~10.6M-parameter Llama with random weights and the tiny model's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    from skyrl_sdk.models.loading import TINY_DIR

    config = LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=257, pad_token_id=258,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    PreTrainedTokenizerFast.from_pretrained(str(TINY_DIR)).save_pretrained(path)
    return path


def _data(n=4, length=64, vocab=256, seed=0):
    from skyrl_sdk import types

    rng = np.random.default_rng(seed)
    return [
        types.Datum(model_input=types.ModelInput.from_ints(rng.integers(0, vocab, length)),
                    loss_fn_inputs={"target_tokens": rng.integers(0, vocab, length)})
        for _ in range(n)
    ]


def _bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def local_memory(backend) -> dict:
    runner = backend.engine.runner
    seen, params, grads = set(), 0, 0
    for p in backend.engine.loaded.module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params += _bytes(p)
            grads += _bytes(p.grad) if p.grad is not None else 0
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": runner.optimizer.state_bytes()}


def _rss(pid: int) -> int | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:
        return None


def measure(model: str, world_size: int) -> dict:
    import skyrl_sdk
    from skyrl_sdk import types

    data = _data()
    adam = types.AdamParams(learning_rate=1e-4)
    out: dict = {"model": os.path.basename(model) if model != "tiny" else "tiny"}
    with skyrl_sdk.Backend(model=model) as local:
        out["num_parameters"] = local.get_info().num_parameters
        local.forward_backward(data)
        grads = local_memory(local)["grad_bytes"]
        local.optim_step(adam)
        mem = local_memory(local)
        mem["grad_bytes"] = grads
        mem["total_bytes"] = mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
        mem["rss_bytes"] = _rss(os.getpid())
        out["local"] = mem
    cfg = {"world_size": world_size}
    with skyrl_sdk.Backend(model=model, engine="fsdp", engine_config=cfg) as fsdp:
        fsdp.forward_backward(data)
        grads = [m["grad_bytes"] for m in fsdp.engine.memory()]
        fsdp.optim_step(adam)
        ranks = fsdp.engine.memory()
        for m, g, pid in zip(ranks, grads, fsdp.engine.rank_pids, strict=True):
            m["grad_bytes"] = g
            m["total_bytes"] = m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]
            m["rss_bytes"] = _rss(pid)
        out[f"fsdp_{world_size}"] = ranks
    local_total = out["local"]["total_bytes"]
    out["per_rank_fraction_of_local"] = [round(m["total_bytes"] / local_total, 4) for m in ranks]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--models", nargs="*", default=["tiny", "llama10m"],
                        help="'tiny', 'llama10m' (built in a temp dir) or HF model directories")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            if model == "llama10m":
                model = make_llama_dir(os.path.join(tmp, "llama10m"))
            results.append(measure(model, args.world_size))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
