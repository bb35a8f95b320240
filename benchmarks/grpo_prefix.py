"""Benchmark: GRPO with long shared prompts against TRL's ``GRPOTrainer`` and against our
``Backend`` with prefix sharing off.

The model, LoRA, task, reward, AdamW settings and the TRL side are ``benchmarks.grpo``'s
(``grpo_task``, ``grpo_sides``); what changes is the prompt: every prompt starts with the same
300-token instruction + few-shot preamble, then its own question (``"042?"``), and the
completions may be up to 32 tokens. 4 prompts x 8 samples per step, as there. Sides:

- ``trl``: ``trl.GRPOTrainer`` (each of the 32 rows carries its prompt, in generation and training);
- ``backend``: our ``Backend`` loop, prefix sharing on (the default): the sampler prefills each
  prompt once, ``forward_backward`` computes each group's prompt once;
- ``backend_unshared``: the same loop with ``engine_config={"prefix_sharing": False}``;
- ``server``: the ``backend`` loop through ``skyrl-sdk serve`` (a subprocess, its defaults:
  prefix sharing on) with the tinker client, as ``benchmarks.grpo``'s server side (its CPU
  seconds include the server process's).

Reported per side: seconds per RL step (median over steps after the first), CPU seconds, the
reward curve; for ours the sampling and training phases; the ratios to TRL (target <= 0.45).

    python -m benchmarks.grpo_prefix --plot docs/performance_grpo_prefix.png   # ~10 min on 1 thread
    python -m benchmarks.grpo_prefix --smoke                                   # seconds
"""

from __future__ import annotations

import sys
from pathlib import Path

import attrs

if __package__ in (None, ""):  # ``python benchmarks/grpo_prefix.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import grpo_task as task
from benchmarks.grpo import available, cli, run_sides
from benchmarks.grpo import plot as grpo_plot

NAME = "grpo_long_prompts"
TARGET = 0.45
LABELS = {"trl": "TRL GRPOTrainer", "backend": "skyrl-sdk Backend (prefix sharing)",
          "backend_unshared": "skyrl-sdk Backend, sharing off", "server": "skyrl-sdk serve + tinker (prefix sharing)"}
OURS = ("backend", "backend_unshared", "server")


def settings(smoke: bool, steps: int | None = None, max_tokens: int | None = None) -> task.GrpoSettings:
    base = task.settings(smoke, steps or (2 if smoke else 12), max_tokens or (4 if smoke else 32))
    return attrs.evolve(base, preamble=40 if smoke else 300)


def run(ctx) -> dict:
    why = available()
    if why is not None:
        return {"status": why, "target": TARGET}
    import trl

    from benchmarks import grpo_sides

    s = settings(ctx.smoke, getattr(ctx, "grpo_steps", None), getattr(ctx, "grpo_max_tokens", None))
    model_dir = task.model_dir(ctx.workdir, ctx.smoke)
    runners = {
        "trl": lambda: grpo_sides.run_trl(model_dir, s, ctx.workdir),
        "backend": lambda: grpo_sides.run_backend(model_dir, s),
        "backend_unshared": lambda: grpo_sides.run_backend(model_dir, s, {"prefix_sharing": False}),
        "server": lambda: grpo_sides.run_server(model_dir, s, ctx.threads, ctx.log),
    }
    sides = run_sides(ctx, NAME, runners, s, OURS, TARGET)
    sides["backend"]["ratio_to_unshared"] = sides["backend"]["step_s"]["median"] / sides["backend_unshared"][
        "step_s"]["median"]
    prompt_tokens = len(task.prompt_ids(_tokenizer(model_dir), task.prompt_texts(s)[0]))
    return {"status": "ok", "model": task.model_info(ctx.smoke), "settings": attrs.asdict(s),
            "prompt_tokens": prompt_tokens, "trl_version": trl.__version__, "threads": ctx.threads,
            "sides": sides, "target": TARGET}


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def targets(result: dict) -> list[dict]:
    rows = []
    for side in OURS:
        v = result["sides"][side]["ratio_to_trl"]
        rows.append({"benchmark": NAME, "metric": f"RL step-time ratio, long shared prompts ({side} / TRL)",
                     "median": v, "min": v, "max": v, "target": result["target"],
                     "verdict": result["sides"][side]["verdict"]})
    return rows


def table(result: dict) -> list[str]:
    if result.get("status") != "ok":
        return [f"{NAME}: {result.get('status')}"]
    lines = [f"prompts of {result['prompt_tokens']} tokens, {result['settings']['groups']} x "
             f"{result['settings']['group_size']} samples of <= {result['settings']['max_tokens']} tokens", "",
             "| side | s/step median (min-max) | CPU s/step | sample / train s | ratio to TRL | reward first -> last |",
             "|---|---|---|---|---|---|"]
    for name in LABELS:
        side = result["sides"][name]
        st = side["step_s"]
        phases = (f"{side['sample_s']['median']:.3f} / {side['train_s']['median']:.3f}" if "sample_s" in side
                  else "-")
        ratio = f"{side['ratio_to_trl']:.2f} (<= {result['target']}: {side['verdict']})" if name != "trl" else "1"
        lines.append(f"| {name} | {st['median']:.3f} ({st['min']:.3f}-{st['max']:.3f}) | "
                     f"{side['cpu_step_s']['median']:.3f} | {phases} | {ratio} | "
                     f"{side['reward_first']:+.3f} -> {side['reward_last']:+.3f} |")
    return lines


def plot(result: dict, path) -> str:
    return grpo_plot(result, path, LABELS, title=f" with {result['prompt_tokens']}-token shared prompts")


def main(argv=None) -> int:
    return cli(argv, module=sys.modules[__name__], steps="12", max_tokens="32")


if __name__ == "__main__":
    sys.exit(main())
