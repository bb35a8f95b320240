"""The demo and docs/rl.md's recipe with torch's default threads vs fewer, on cores other jobs use.

    python -m benchmarks.threads                  # 2 busy processes, torch's default vs 1 thread
    python -m benchmarks.threads --busy 0 --threads 1,2 --reps 2

Starts ``--busy`` processes that spin on the CPU (stopped at the end), then runs each case
as a fresh process per thread count, interleaved (A B A B), and prints one JSON document:
the wall time of each run with the 1-minute load average before and after it. Not part of
``benchmarks.run``: it loads the machine on purpose. Summarized in docs/performance.md
("Threads on shared cores").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def torch_default_threads() -> int:
    """What torch picks in a fresh process without OMP_NUM_THREADS."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         env=env, capture_output=True, text=True, check=True)
    return int(out.stdout)


def recipe_script(workdir: Path) -> Path:
    """docs/rl.md's first python block, as a script."""
    block = re.search(r"```python\n(.*?)```", (REPO / "docs" / "rl.md").read_text(), re.S).group(1)
    path = workdir / "rl.py"
    path.write_text(block)
    return path


def commands(workdir: Path, threads: int) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "skyrl_sdk.cli"]
    return {
        "demo": [*cli, "demo", "--json", "--out", str(workdir / "demo"), "--threads", str(threads)],
        "rl_recipe": [sys.executable, str(recipe_script(workdir))],
    }


def timed(cmd: list[str], threads: int, cwd: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stderr[-2000:]}")
    return {"threads": threads, "seconds": round(seconds, 2), "load_before": round(load, 2),
            "load_after": round(os.getloadavg()[0], 2)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=2, help="spinning background processes (default 2)")
    parser.add_argument("--threads", default=None, help="thread counts, comma-separated (default: torch's, 1)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--only", default="demo,rl_recipe")
    args = parser.parse_args(argv)
    default = torch_default_threads()
    counts = [int(t) for t in args.threads.split(",")] if args.threads else [default, 1]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs: dict[str, list[dict]] = {}
    try:
        time.sleep(2 if busy else 0)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            for name in args.only.split(","):
                for _ in range(args.reps):
                    for n in counts:
                        cmd = commands(work, n)[name]
                        runs.setdefault(name, []).append(timed(cmd, n, work))
                        print(f"[threads] {name} threads={n}: {runs[name][-1]}", file=sys.stderr, flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    result = {"cpu_count": os.cpu_count(), "torch_default_threads": default, "busy_processes": args.busy,
              "runs": runs}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
