"""Benchmark: ``optim_step`` against the bare step a user writes by hand.

The bare step is ``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.AdamW(fused=True)`` +
``zero_grad(set_to_none=True)`` on copies of the same parameters with the same gradients.
Ours is ``Backend.optim_step(AdamParams(...))`` with the same hyper-parameters: it also keeps
its guarantee (a step that would make a weight or moment non-finite is skipped and
reported). Both sides get fresh copies of one real gradient before each timed step
(untimed), full fine-tuning and LoRA (rank 16: many small tensors, where per-tensor Python
work shows).
"""

from __future__ import annotations

from .common import (
    ADAM,
    alternate,
    check_verdict,
    make_model_dir,
    make_sft_rows,
    num_parameters,
    ratio_summary,
    rows_to_datums,
    summary,
)

NAME = "optim_step"
#: ours / bare, per mode (issue 22: at most 1.3x, no temporary larger than the largest tensor;
#: issue 29, with the optimizer a component of its own: at most 1.15x)
TARGETS = {"full": 1.15, "lora": 1.15}
CLIP = 1.0


def _case(model_dir, lora: bool, ctx) -> dict:
    import torch

    from skyrl_sdk import Backend, types

    adam = types.AdamParams(**ADAM, grad_clip_norm=CLIP)
    backend = Backend(model=str(model_dir), lora=types.LoraConfig(rank=16) if lora else None,
                      engine_config=ctx.engine_config)
    try:
        rows = make_sft_rows([48, 32, 64, 40], ctx.model_spec["vocab"], seed=11)
        backend.forward_backward(rows_to_datums(rows), "cross_entropy")
        params = [p for _, p in backend.engine.runner.named_trainable()]  # what runner.optimizer steps
        grads = [p.grad.detach().clone() for p in params]
        backend.optim_step(adam)  # moments exist from here on, on both sides
        bare = [p.detach().clone().requires_grad_() for p in params]
        bare_opt = torch.optim.AdamW(bare, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                                     weight_decay=adam.weight_decay, fused=True)
        for b, g in zip(bare, grads, strict=True):
            b.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(bare, CLIP)
        bare_opt.step()

        def setup(side: str) -> None:
            for p, g in zip(params if side == "ours" else bare, grads, strict=True):
                p.grad = g.clone()

        def ours() -> None:
            out = backend.optim_step(adam)
            assert out.metrics["skipped"] == 0.0

        def hand() -> None:
            torch.nn.utils.clip_grad_norm_(bare, CLIP)
            bare_opt.step()
            bare_opt.zero_grad(set_to_none=True)

        wall, cpu = alternate({"ours": ours, "bare": hand}, reps=ctx.reps * 5, warmup=2, setup=setup)
        largest = max(p.numel() * p.element_size() for p in params)
        return {
            "tensors": len(params),
            "trainable_parameters": sum(p.numel() for p in params),
            "largest_tensor_bytes": largest,
            "ours_s": summary(cpu["ours"]),
            "bare_s": summary(cpu["bare"]),
            "ratio": ratio_summary(cpu["ours"], cpu["bare"]),
            "wall_ratio": ratio_summary(wall["ours"], wall["bare"]),
        }
    finally:
        backend.close()


def run(ctx) -> dict:
    spec = ctx.model_spec
    model_dir = make_model_dir(ctx.workdir / "model_optim_step", spec)
    out = {"model": {**spec, "parameters": num_parameters(spec)}, "grad_clip_norm": CLIP, "cases": {}}
    for mode in ("full", "lora"):
        case = _case(model_dir, mode == "lora", ctx)
        case["target"] = TARGETS[mode]
        case["verdict"] = check_verdict(case["ratio"]["median"], TARGETS[mode])
        out["cases"][mode] = case
    return out


def table(result: dict) -> list[str]:
    lines = ["| mode | tensors | ours (CPU ms) | bare (CPU ms) | ratio median (min-max) | target |", "|---|---|---|---|---|---|"]
    for mode, c in result["cases"].items():
        r = c["ratio"]
        lines.append(f"| {mode} | {c['tensors']} | {1e3 * c['ours_s']['median']:.2f} | {1e3 * c['bare_s']['median']:.2f} | "
                     f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | <= {c['target']} ({c['verdict']}) |")
    return lines
