"""The three sides of the GRPO benchmark. Each runs ``s.steps`` RL steps on the same model,
prompts, reward and hyper-parameters and returns per-step wall seconds, CPU seconds and the
mean reward of each step's samples.

Loss: every side takes the policy gradient of ``-A * logprob`` summed over completion tokens
and divided by the number of completion tokens in the step (TRL's default ``dapo``
normalisation); ours pass ``advantage / tokens`` to ``importance_sampling``, whose ratio is
1 on-policy, so the gradients agree.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from . import grpo_task as task
from .grpo_task import GrpoSettings


class StepClock:
    """Wall and CPU seconds of each step; ``cpu_of`` adds other processes' CPU (a server)."""

    def __init__(self, cpu_of=None) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.cpu_of = cpu_of or (lambda: 0.0)

    def start(self) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time() + self.cpu_of()

    def stop(self) -> None:
        self.wall.append(time.perf_counter() - self._t0)
        self.cpu.append(time.process_time() + self.cpu_of() - self._c0)

    def result(self, rewards: list[float]) -> dict[str, Any]:
        return {"step_s": self.wall, "cpu_s": self.cpu, "reward": rewards}


def build_datums(prompts: list[list[int]], groups: list[list[Any]], tokenizer) -> tuple[list, float]:
    """GRPO datums (skyrl-sdk ``Datum``s) of one step and its mean reward."""
    from skyrl_sdk.rl import datum_from_sample, group_advantages

    n_tokens = sum(len(s.tokens) for group in groups for s in group)
    rewards, picked = [], []
    for prompt, group in zip(prompts, groups, strict=True):
        r = [task.reward(tokenizer.decode(list(s.tokens), skip_special_tokens=True)) for s in group]
        rewards += r
        picked += [(prompt, s, a) for s, a in zip(group, group_advantages(r), strict=True) if a != 0 and s.tokens]
    data = [datum_from_sample(p, s, a / max(n_tokens, 1)) for p, s, a in picked]
    return data, sum(rewards) / len(rewards)


# ---- (b) our Backend loop -------------------------------------------------------------------
def run_backend(model_dir: Path, s: GrpoSettings, engine_config: dict | None = None) -> dict[str, Any]:
    from skyrl_sdk import Backend, types

    lora = types.LoraConfig(rank=s.lora_rank, alpha=s.lora_alpha, seed=s.seed, train_unembed=False)
    clock, rewards = StepClock(), []
    phases: dict[str, list[float]] = {"sample_s": [], "train_s": []}
    with Backend(model=str(model_dir), lora=lora, seed=s.seed, engine_config=engine_config) as backend:
        tok = backend.tokenizer
        params = types.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, stop=[tok.eos_token_id])
        adam = types.AdamParams(**s.adam_kwargs())
        texts = task.prompt_texts(s)
        for step in range(s.steps):
            clock.start()
            prompts = [task.prompt_ids(tok, t) for t in texts[step * s.groups:(step + 1) * s.groups]]
            # seeded per step, as TRL's generation is: the curve is the same in every run
            # (the server side stays unseeded: seeded requests are not batched together there)
            step_params = attrs.evolve(params, seed=s.seed * 1_000_003 + step)
            t0 = time.perf_counter()
            outs = backend.sample(prompts, step_params, num_samples=s.group_size)
            data, mean = build_datums(prompts, [o.sequences for o in outs], tok)
            t1 = time.perf_counter()
            if data:
                backend.forward_backward(data, "importance_sampling")
                backend.optim_step(adam)
            clock.stop()
            phases["sample_s"].append(t1 - t0)
            phases["train_s"].append(time.perf_counter() - t1)
            rewards.append(mean)
    return {**clock.result(rewards), **phases}


# ---- (c) skyrl-sdk serve + the tinker client ---------------------------------------------------
def _to_tinker(datum):
    import numpy as np
    from tinker import types as tt

    return tt.Datum(model_input=tt.ModelInput.from_ints(datum.model_input.to_ints()),
                    loss_fn_inputs={k: tt.TensorData.from_numpy(np.asarray(v.array))
                                    for k, v in datum.loss_fn_inputs.items()})


def run_server(model_dir: Path, s: GrpoSettings, threads: int, log) -> dict[str, Any]:
    import psutil
    import tinker
    from tinker import types as tt
    from transformers import AutoTokenizer

    from .server import API_KEY, ServerProcess

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = task.prompt_texts(s)
    params = tt.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, stop=[tok.eos_token_id])
    adam = tt.AdamParams(**s.adam_kwargs())
    rewards: list[float] = []
    with tempfile.TemporaryDirectory(prefix="skyrl-bench-grpo-") as state_dir:
        server = ServerProcess(state_dir, threads, model=str(model_dir))
        proc = psutil.Process(server.proc.pid)
        clock = StepClock(cpu_of=lambda: sum(proc.cpu_times()[:2]))
        try:
            service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
            client = service.create_lora_training_client(base_model=str(model_dir), rank=s.lora_rank, seed=s.seed,
                                                         train_unembed=False)
            client = client.result() if hasattr(client, "result") else client
            try:
                for step in range(s.steps):
                    clock.start()
                    sampler = client.save_weights_and_get_sampling_client()
                    sampler = sampler.result() if hasattr(sampler, "result") else sampler
                    prompts = [task.prompt_ids(tok, t) for t in texts[step * s.groups:(step + 1) * s.groups]]
                    futures = [sampler.sample(tt.ModelInput.from_ints(p), s.group_size, params) for p in prompts]
                    groups = [f.result().sequences for f in futures]
                    data, mean = build_datums(prompts, groups, tok)
                    if data:
                        fb = client.forward_backward([_to_tinker(d) for d in data], "importance_sampling")
                        opt = client.optim_step(adam)
                        fb.result()
                        opt.result()
                    clock.stop()
                    rewards.append(mean)
            finally:
                try:  # finish the session: stops the client's heartbeat thread
                    service.close("success").result(timeout=30)
                except Exception as exc:
                    log(f"grpo: closing the tinker session failed: {exc}")
        finally:
            server.stop()
    return clock.result(rewards)


# ---- (a) TRL's GRPOTrainer -------------------------------------------------------------------
def run_trl(model_dir: Path, s: GrpoSettings, workdir: Path) -> dict[str, Any]:
    import peft
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    clock, rewards = StepClock(), []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.start()

        def on_step_end(self, args, state, control, **kw):
            clock.stop()

    def four_digits(completions, **kw) -> list[float]:
        values = [task.reward(c) for c in completions]
        rewards.append(sum(values) / len(values))
        return values

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lora = peft.LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0, bias="none",
                           target_modules=task.lora_targets(model_dir))
    data = Dataset.from_dict({"prompt": [task.BOS_TEXT + t for t in task.prompt_texts(s)]})
    config = GRPOConfig(
        output_dir=str(Path(workdir) / "trl-out"), max_steps=s.steps, seed=s.seed, data_seed=s.seed,
        per_device_train_batch_size=s.groups * s.group_size, gradient_accumulation_steps=1,
        num_generations=s.group_size, max_completion_length=s.max_tokens, temperature=s.temperature,
        top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="dapo", scale_rewards="group",
        learning_rate=s.learning_rate, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=s.beta1, adam_beta2=s.beta2, adam_epsilon=s.eps, weight_decay=0.0, max_grad_norm=s.grad_clip_norm,
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, shuffle_dataset=False,
        report_to="none", logging_steps=max(1, s.steps), save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=four_digits, args=config, train_dataset=data,
                          processing_class=tok, peft_config=lora, callbacks=[Timer()])
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its log dicts; stdout is our JSON
        trainer.train()
    if len(rewards) != s.steps or len(clock.wall) != s.steps:
        raise RuntimeError(f"TRL ran {len(clock.wall)} steps with {len(rewards)} reward calls; expected {s.steps}")
    return clock.result(rewards)
