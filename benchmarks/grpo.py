"""Benchmark: an end-to-end GRPO run against TRL's ``GRPOTrainer``, the tool users would
pick instead.

Three sides train the same 10.6M-parameter Llama (random init, the tiny byte-level
tokenizer) with the same LoRA (rank 16, alpha 32, attention + MLP), task
(docs/rl.md's "answer with exactly four digits"), prompts, group size, completion length,
AdamW settings, learning rate and number of steps:

- ``trl``: ``trl.GRPOTrainer`` (beta=0, loss_type="dapo", one optimizer step per generation batch);
- ``backend``: our ``Backend`` loop (sample -> group_advantages -> importance_sampling -> optim_step);
- ``server``: the same loop through ``skyrl-sdk serve`` (a subprocess) with the tinker client.

Reported per side: seconds per RL step (median over steps after the first), CPU seconds per
step (the server's process included), the reward curve, and the ratio to TRL (target <= 0.5).

    python -m benchmarks.grpo --plot docs/performance_grpo.png   # the full run (~5 min)
    python -m benchmarks.grpo --smoke                            # seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/grpo.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import grpo_task as task
from benchmarks.common import check_verdict, run_standalone, summary

NAME = "grpo"
TARGET = 0.5
SIDES = ("trl", "backend", "server")


def available() -> str | None:
    try:
        import peft  # noqa: F401
        import psutil  # noqa: F401
        import tinker  # noqa: F401
        import trl  # noqa: F401
    except ImportError as exc:
        return f"not available ({exc}; pip install 'skyrl-sdk[bench,lora,server]')"
    return None


def _side(raw: dict, s: task.GrpoSettings) -> dict:
    timed = raw["step_s"][1:] or raw["step_s"]  # the first step pays one-off warm-up
    cpu = raw["cpu_s"][1:] or raw["cpu_s"]
    k = max(1, s.steps // 5)
    side = {"step_s": summary(timed), "cpu_step_s": summary(cpu), "total_s": sum(raw["step_s"]),
            "reward": [round(r, 4) for r in raw["reward"]], "reward_first": sum(raw["reward"][:k]) / k,
            "reward_last": sum(raw["reward"][-k:]) / k}
    for phase in ("sample_s", "train_s"):  # our Backend loop's phases
        if phase in raw:
            side[phase] = summary(raw[phase][1:] or raw[phase])
    return side


def run_sides(ctx, name: str, runners: dict, s: task.GrpoSettings, ours: tuple[str, ...], target: float) -> dict:
    """Run each side in turn; ``ours`` get their ratios to TRL's step time and a verdict."""
    sides = {}
    for side, runner in runners.items():
        ctx.log(f"{name}: {side} ({s.steps} steps) ...")
        t0 = time.perf_counter()
        sides[side] = _side(runner(), s)
        ctx.log(f"{name}: {side} {sides[side]['step_s']['median']:.3f} s/step, reward "
                f"{sides[side]['reward_first']:+.3f} -> {sides[side]['reward_last']:+.3f} "
                f"({time.perf_counter() - t0:.0f} s)")
    trl_s, trl_cpu = sides["trl"]["step_s"]["median"], sides["trl"]["cpu_step_s"]["median"]
    for side in ours:
        sides[side]["ratio_to_trl"] = sides[side]["step_s"]["median"] / trl_s
        sides[side]["cpu_ratio_to_trl"] = sides[side]["cpu_step_s"]["median"] / trl_cpu
        sides[side]["verdict"] = check_verdict(sides[side]["ratio_to_trl"], target)
    return sides


def run(ctx) -> dict:
    why = available()
    if why is not None:
        return {"status": why, "target": TARGET}
    import attrs
    import trl

    from benchmarks import grpo_sides

    s = task.settings(ctx.smoke, getattr(ctx, "grpo_steps", None), getattr(ctx, "grpo_max_tokens", None))
    model_dir = task.model_dir(ctx.workdir, ctx.smoke)
    runners = {
        "trl": lambda: grpo_sides.run_trl(model_dir, s, ctx.workdir),
        "backend": lambda: grpo_sides.run_backend(model_dir, s),
        "server": lambda: grpo_sides.run_server(model_dir, s, ctx.threads, ctx.log),
    }
    sides = run_sides(ctx, NAME, runners, s, ("backend", "server"), TARGET)
    return {
        "status": "ok",
        "model": task.model_info(ctx.smoke),
        "settings": attrs.asdict(s),
        "trl_version": trl.__version__,
        "threads": ctx.threads,
        "sides": sides,
        "target": TARGET,
    }


def table(result: dict) -> list[str]:
    if result.get("status") != "ok":
        return [f"grpo: {result.get('status')}"]
    lines = ["| side | s/step median (min-max) | CPU s/step | ratio to TRL | reward first -> last |",
             "|---|---|---|---|---|"]
    for name in SIDES:
        side = result["sides"][name]
        st = side["step_s"]
        ratio = f"{side['ratio_to_trl']:.2f} (<= {result['target']}: {side['verdict']})" if name != "trl" else "1"
        lines.append(f"| {name} | {st['median']:.3f} ({st['min']:.3f}-{st['max']:.3f}) | "
                     f"{side['cpu_step_s']['median']:.3f} | {ratio} | "
                     f"{side['reward_first']:+.3f} -> {side['reward_last']:+.3f} |")
    return lines


LABELS = {"trl": "TRL GRPOTrainer", "backend": "skyrl-sdk Backend", "server": "skyrl-sdk serve + tinker"}


def plot(result: dict, path, labels: dict[str, str] = LABELS, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for name in labels:
        side = result["sides"][name]
        steps = range(1, len(side["reward"]) + 1)
        axes[0].plot(steps, side["reward"], marker=".", label=labels[name])
        elapsed, t = [], 0.0
        per_step = side["step_s"]["values"]
        for dt in [side["total_s"] - sum(per_step)] + list(per_step):
            t += dt
            elapsed.append(t)
        axes[1].plot(elapsed, side["reward"], marker=".", label=labels[name])
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("wall seconds")
    for ax in axes:
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    m = result["model"]
    fig.suptitle(f"GRPO{title}, {m['parameters'] / 1e6:.1f}M-param Llama, LoRA r{result['settings']['lora_rank']}: "
                 "reward per step and over time", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=80)
    plt.close(fig)
    return str(path)


def main(argv=None) -> int:
    return cli(argv, module=sys.modules[__name__], steps="30", max_tokens="6")


def cli(argv, *, module, steps: str, max_tokens: str) -> int:
    """The command line of a GRPO benchmark ``module`` (its ``run``, ``table``, ``plot``, docstring)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{Path(module.__file__).stem}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="toy model, 2 steps: checks that every side runs")
    p.add_argument("--steps", type=int, default=None, help=f"RL steps per side (default: {steps}; smoke: 2)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"completion length limit (default: {max_tokens}; smoke: 4)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    p.add_argument("--plot", default=None, help="write the reward-curve plot (PNG) here")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    result = run_standalone(module.run, smoke=args.smoke, threads=args.threads, quiet=args.quiet,
                            name=Path(module.__file__).stem, grpo_steps=args.steps, grpo_max_tokens=args.max_tokens)
    if args.plot and result.get("status") == "ok":
        result["plot"] = module.plot(result, args.plot)
    print(json.dumps(result, indent=2))
    if not args.quiet and result.get("status") == "ok":
        print("\n".join(module.table(result)), file=sys.stderr)
    return 0 if result.get("status") == "ok" or result["status"].startswith("not available") else 1


if __name__ == "__main__":
    sys.exit(main())
