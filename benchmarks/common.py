"""Shared pieces of the benchmarks: model directories, data, the hand-written loop, timing.

Every comparison runs both sides in one process, alternating (A B B A A B ...) after a
warm-up, with the same weights and data, and reports the median and min-max of the
per-repetition ratios: on shared 2-core machines absolute times drift, ratios much less.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TINY_ASSETS = REPO / "src" / "skyrl_sdk" / "assets" / "tiny"

#: The ~10M-parameter Llama of the step-time benchmarks (8.9M parameters).
MODEL_10M = dict(vocab=8192, hidden=256, intermediate=768, layers=6, heads=8, kv_heads=4, tie=False)
#: The memory benchmark's model: vocabulary 32k (tied embeddings keep it at ~11M parameters).
MODEL_32K = dict(vocab=32000, hidden=256, intermediate=768, layers=4, heads=8, kv_heads=4, tie=True)
#: Smoke mode: the same code paths at toy sizes.
MODEL_SMOKE = dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tie=False)

#: AdamW hyper-parameters of both sides (Tinker's defaults).
ADAM = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0)


#: One thread by default: on small shared machines more threads than free cores turn
#: OpenMP's spin-waits into noise; ``--threads N`` pins another count.
DEFAULT_THREADS = 1


def set_threads(n: int | None) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    n = n or DEFAULT_THREADS
    torch.set_num_threads(n)
    return n


def run_standalone(run: Callable[[Any], dict], *, smoke: bool, threads: int | None, quiet: bool, name: str,
                   **settings: Any) -> dict:
    """A benchmark's ``run(ctx)`` from its own command line: threads set, skyrl_sdk's logging at
    WARNING, a temporary work directory, progress on stderr unless ``quiet``; ``settings``
    become attributes of the context. Returns the result with its ``seconds``."""
    import logging
    import tempfile
    from types import SimpleNamespace

    threads = set_threads(threads)
    logging.getLogger("skyrl_sdk").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix=f"skyrl-bench-{name}-") as tmp:
        ctx = SimpleNamespace(smoke=smoke, workdir=Path(tmp), threads=threads, **settings,
                              log=(lambda m: None) if quiet else
                              (lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True)))
        t0 = time.perf_counter()
        result = run(ctx)
        result["seconds"] = time.perf_counter() - t0
    return result


# ---- statistics ---------------------------------------------------------------------------
def summary(values: Sequence[float]) -> dict[str, Any]:
    vals = [float(v) for v in values]
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "values": [round(v, 6) for v in vals],
    }


def ratio_summary(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Per-repetition ratios a_i / b_i (each pair measured back to back)."""
    return summary([x / y for x, y in zip(a, b, strict=True)])


def alternate(
    sides: Mapping[str, Callable[[], Any]], reps: int, warmup: int = 1,
    setup: Callable[[str], Any] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Time each side ``reps`` times, interleaved; the order flips every repetition (ABBA).

    Returns (wall-clock seconds, this process's CPU seconds) per side. CPU time counts only
    the time the process actually ran, so it is much less sensitive to other jobs on a
    shared machine (for in-process compute; a server or worker ranks run elsewhere).
    ``setup(side)``, when given, runs untimed before each call of that side.
    """
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            if setup is not None:
                setup(name)
            sides[name]()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            if setup is not None:
                setup(name)
            c0, t0 = time.process_time(), time.perf_counter()
            sides[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def check_verdict(value: float, target: float) -> str:
    return "met" if value <= target else "NOT met"


# ---- models and data ----------------------------------------------------------------------
def llama_config(spec: Mapping[str, Any]):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=bool(spec.get("tie", False)),
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        architectures=["LlamaForCausalLM"],
    )


def make_model_dir(directory: Path, spec: Mapping[str, Any], seed: int = 0) -> Path:
    """A Hugging Face model directory: random weights (seeded) + the tiny tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(llama_config(spec))
    model.save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_ASSETS / name, directory / name)
    return directory


def num_parameters(spec: Mapping[str, Any]) -> int:
    h, i, v, n = spec["hidden"], spec["intermediate"], spec["vocab"], spec["layers"]
    head = h // spec["heads"]
    attn = h * h * 2 + 2 * h * head * spec["kv_heads"]
    per_layer = attn + 3 * h * i + 2 * h
    return v * h * (1 if spec.get("tie") else 2) + n * per_layer + h


def make_sft_rows(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Random SFT rows: tokens, next-token targets, weights 0 on a ~30% 'prompt' prefix."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        seq = rng.integers(0, vocab, int(n) + 1, dtype=np.int64)
        w = np.ones(int(n), dtype=np.float32)
        w[: int(n) * 3 // 10] = 0.0
        rows.append({"tokens": seq[:-1].copy(), "targets": seq[1:].copy(), "weights": w})
    return rows


def rows_to_datums(rows):
    from skyrl_sdk import types

    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(r["tokens"]),
            loss_fn_inputs={"target_tokens": r["targets"], "weights": r["weights"]},
        )
        for r in rows
    ]


def rows_to_json(rows) -> list[dict[str, Any]]:
    """Tinker's JSON shape with Python lists (what a server request decodes to)."""
    return [
        {
            "model_input": {"chunks": [{"type": "encoded_text", "tokens": r["tokens"].tolist()}]},
            "loss_fn_inputs": {
                "target_tokens": {"data": r["targets"].tolist(), "dtype": "int64", "shape": [len(r["targets"])]},
                "weights": {"data": r["weights"].tolist(), "dtype": "float32", "shape": [len(r["weights"])]},
            },
        }
        for r in rows
    ]


# ---- the two sides ------------------------------------------------------------------------
class HandLoop:
    """What a user writes by hand with transformers + torch.

    Pad to the longest sequence, pass the attention mask, ``log_softmax`` + ``gather`` over
    the full logits, weighted sum, ``backward``, ``torch.optim.AdamW``.
    """

    def __init__(self, model_dir: str | Path, pad_id: int = 258) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.config.use_cache = False
        self.model.train()
        self.pad_id = pad_id
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]),
            eps=ADAM["eps"], weight_decay=ADAM["weight_decay"],
        )

    def pad(self, rows):
        torch = self.torch
        width = max(len(r["tokens"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        tgt = torch.zeros((len(rows), width), dtype=torch.long)
        w = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, r in enumerate(rows):
            n = len(r["tokens"])
            ids[i, :n] = torch.from_numpy(r["tokens"])
            mask[i, :n] = 1
            tgt[i, :n] = torch.from_numpy(r["targets"])
            w[i, :n] = torch.from_numpy(r["weights"])
        return ids, mask, tgt, w

    def loss(self, rows):
        torch = self.torch
        ids, mask, tgt, w = self.pad(rows)
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        return -(lp * w).sum()

    def forward_backward(self, rows) -> float:
        loss = self.loss(rows)
        loss.backward()
        return float(loss.detach())

    def optim_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, rows) -> float:
        value = self.forward_backward(rows)
        self.optim_step()
        return value


class SdkSide:
    """``Backend.forward_backward(cross_entropy)`` + ``optim_step`` on the same weights."""

    def __init__(self, model_dir: str | Path, engine_config: Mapping[str, Any] | None = None) -> None:
        from skyrl_sdk import Backend, types

        self.backend = Backend(model=str(model_dir), engine_config=dict(engine_config or {}))
        self.adam = types.AdamParams(**ADAM)

    def forward_backward(self, datums):
        return self.backend.forward_backward(datums, "cross_entropy")

    def step(self, datums):
        out = self.forward_backward(datums)
        self.backend.optim_step(self.adam)
        return out

    def close(self) -> None:
        self.backend.close()


def emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def proc_status(field: str, pid: int | str = "self") -> int:
    """A byte count from ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``, ...)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def run_worker(module: str, args: Sequence[str], what: str, timeout: int = 1800,
               env: Mapping[str, str] | None = None) -> Any:
    """Run ``python -m <module> <args>`` in a fresh process (a clean memory baseline; ``env``
    adds variables) and return the JSON document on its last stdout line."""
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} worker failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
