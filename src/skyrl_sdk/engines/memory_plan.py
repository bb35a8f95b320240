"""The memory plan of a trainer and a colocated vLLM sampler on one GPU, from the engines' own
accounting (docs/engines.md, "Training and sampling on one GPU", is generated from it).

What each side holds, by phase of an RL step:

- **the trainer** (local engine): every parameter in the master dtype (``master_dtype``: 4 bytes,
  or 2 in bfloat16); every *trained* parameter also a gradient and AdamW's two moments, in the
  same dtype (``engines/optimizer.py``); while a ``forward_backward`` runs on top of pending
  gradients with ``keep_grads_on_error``, one more gradient buffer (``engines/call_grads.py``);
  and the activations of a micro-batch (a reserve given by the caller: they depend on
  ``micro_batch_tokens`` and ``gradient_checkpointing``). With ``offload_while_sampling`` the
  parameters, gradients and moments wait in host memory while vLLM samples.
- **vLLM**: its copy of the weights in its dtype (bf16 on a GPU: ``sampler_dtype``), its KV cache,
  and a working reserve (CUDA graphs, sampler buffers). Asleep (``sleep_level`` 1 or 2) it holds
  none of them while the trainer computes.

:func:`plan` adds these up per phase and says what is left for the KV cache while sampling,
in GiB and in tokens; :func:`markdown_table` renders the docs' table of :data:`DOC_CASES`.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

GIB = 2**30
#: the least KV cache worth sampling with (a few thousand tokens of a 7B model)
MIN_KV_GIB = 1.0
#: the most of the device the plan gives vLLM (its own default ``gpu_memory_utilization``): the
#: rest is the CUDA context, fragmentation and what nobody counted
MAX_UTILIZATION = 0.9
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@attrs.frozen
class ModelSize:
    """A decoder's sizes (as in its config.json)."""

    name: str
    parameters: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    def lora_parameters(self, rank: int) -> int:
        """Parameters of rank-``rank`` LoRA on every attention and MLP projection (what
        ``LoraConfig`` adapts by default: ``train_attn`` and ``train_mlp``)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
        return rank * per_layer * self.layers

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES[dtype]


#: Qwen2.5-1.5B and Qwen2.5-7B (their config.json)
QWEN_1P5B = ModelSize("1.5B (Qwen2.5-1.5B)", 1_543_714_304, 28, 1536, 8960, 12, 2, 128)
QWEN_7B = ModelSize("7B (Qwen2.5-7B)", 7_615_616_512, 28, 3584, 18944, 28, 4, 128)


@attrs.frozen
class Setup:
    """One way to run a trainer and vLLM on one device."""

    model: ModelSize
    lora_rank: int | None = None
    master_dtype: str = "float32"
    vllm_dtype: str = "bfloat16"
    #: engine_config["offload_while_sampling"]
    offload_while_sampling: bool = False
    #: sampler_config["sleep_level"]
    sleep_level: int = 1
    #: engine_config["keep_grads_on_error"] (the extra buffer exists only while a call runs on
    #: top of pending gradients: counted when ``accumulate`` says calls accumulate)
    keep_grads_on_error: bool = True
    accumulate: bool = False
    activations_gib: float = 8.0
    vllm_reserve_gib: float = 2.0
    device_gib: float = 80.0


def trainer_bytes(setup: Setup) -> dict[str, int]:
    """The trainer's resident bytes by kind (parameters, gradients, AdamW moments, the kept
    gradient buffer): what the local engine allocates, before activations."""
    m = BYTES[setup.master_dtype]
    total = setup.model.parameters + (setup.model.lora_parameters(setup.lora_rank) if setup.lora_rank else 0)
    trained = setup.model.lora_parameters(setup.lora_rank) if setup.lora_rank else setup.model.parameters
    kept = trained * m if setup.keep_grads_on_error and setup.accumulate else 0
    return {"parameters": total * m, "gradients": trained * m, "adamw": 2 * trained * m, "kept_gradients": kept}


def plan(setup: Setup) -> dict[str, float]:
    """GiB on the device per phase, and the KV cache that fits while sampling."""
    trainer = sum(trainer_bytes(setup).values()) / GIB
    vllm_weights = setup.model.parameters * BYTES[setup.vllm_dtype] / GIB
    # asleep, vLLM keeps only its reserve (CUDA context, graphs); awake, its weights and KV cache too
    training = trainer + setup.activations_gib + setup.vllm_reserve_gib
    if not setup.sleep_level:
        training += vllm_weights
    resident = 0.0 if setup.offload_while_sampling else trainer
    kv = min(setup.device_gib - resident, MAX_UTILIZATION * setup.device_gib) - vllm_weights - setup.vllm_reserve_gib
    if not setup.sleep_level:  # awake while training: its KV cache must fit beside the trainer's peak
        kv = min(kv, setup.device_gib - training)
        training += max(0.0, kv)
    kv = max(0.0, kv)
    return {"trainer_gib": trainer, "training_phase_gib": training, "vllm_weights_gib": vllm_weights,
            "sampling_phase_gib_before_kv": resident + vllm_weights + setup.vllm_reserve_gib,
            "kv_cache_gib": kv, "kv_tokens": kv * GIB / setup.model.kv_bytes_per_token(setup.vllm_dtype),
            "fits": training <= setup.device_gib and kv >= MIN_KV_GIB,
            "gpu_memory_utilization": (vllm_weights + setup.vllm_reserve_gib + kv) / setup.device_gib}


def _describe(s: Setup) -> str:
    what = f"LoRA r{s.lora_rank}" if s.lora_rank else "full"
    masters = "bf16 masters" if s.master_dtype == "bfloat16" else "fp32 masters"
    parts = [what, masters, f"sleep {s.sleep_level}", "offload" if s.offload_while_sampling else "no offload"]
    return ", ".join(parts)


#: the cases docs/engines.md shows (one 80 GB GPU, 8 GiB of activations, 2 GiB vLLM reserve)
DOC_CASES = tuple(
    Setup(model, lora_rank=rank, master_dtype=masters, offload_while_sampling=offload, sleep_level=sleep)
    for model in (QWEN_1P5B, QWEN_7B)
    for rank, masters, offload, sleep in (
        (None, "float32", False, 0), (None, "float32", False, 1), (None, "float32", True, 1),
        (None, "bfloat16", True, 1), (32, "float32", False, 0), (32, "float32", True, 1))
)


def markdown_table(setups: Sequence[Setup] = DOC_CASES) -> str:
    """The docs' table: one row per setup."""
    rows = ["| model | setup | trainer (GiB) | training phase (GiB) | sampling phase before KV (GiB) | "
            "KV cache left (GiB / tokens) | gpu_memory_utilization | fits |",
            "|---|---|---|---|---|---|---|---|"]
    for s in setups:
        p = plan(s)
        kv = f"{p['kv_cache_gib']:.1f} / {p['kv_tokens'] / 1e3:.0f}k" if p["kv_cache_gib"] > 0 else "none"
        rows.append(f"| {s.model.name} | {_describe(s)} | {p['trainer_gib']:.1f} | {p['training_phase_gib']:.1f} | "
                    f"{p['sampling_phase_gib_before_kv']:.1f} | {kv} | {p['gpu_memory_utilization']:.2f} | "
                    f"{'yes' if p['fits'] else 'no'} |")
    return "\n".join(rows)
