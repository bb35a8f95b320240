"""``run_all.sh``'s bookkeeping: one JSON file per step as it ends, and ``summary.json`` at the end.

    python -m scripts.gpu.summary step OUT NAME STATUS EXIT_CODE SECONDS LOG [RESULT_JSON] -- COMMAND...
    python -m scripts.gpu.summary collect OUT DEVICE

A step's status is ``passed``, ``failed`` or ``skipped: <why>``. A check step's own JSON (its
checks, each passed / failed / skipped) is folded into its entry. ``collect`` prints one line per
step and exits 1 when a step failed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def record(out: Path, name: str, status: str, code: str, seconds: str, log: str, result: str | None,
           command: list[str]) -> None:
    steps = out / "steps"
    steps.mkdir(parents=True, exist_ok=True)
    entry = {"name": name, "status": status, "exit_code": None if code == "" else int(code),
             "seconds": round(float(seconds), 1) if seconds else 0.0, "log": log or None, "command": command}
    if result and Path(result).is_file():
        try:
            doc = json.loads(Path(result).read_text())
            entry["result"] = result
            entry["checks"] = [{k: c.get(k) for k in ("name", "status", "reason", "error", "detail") if k in c}
                               for c in doc.get("checks", [])]
        except ValueError as exc:
            entry["result_error"] = f"{result}: {exc}"
    index = len(list(steps.glob("*.json")))
    (steps / f"{index:02d}_{name}.json").write_text(json.dumps(entry, indent=1, default=str))


def collect(out: Path, device: str) -> int:
    entries = [json.loads(p.read_text()) for p in sorted((out / "steps").glob("*.json"))]
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for e in entries:
        counts["skipped" if e["status"].startswith("skipped") else e["status"]] += 1
    summary = {"device": device, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "counts": counts, "steps": entries}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for e in entries:
        checks = e.get("checks", [])
        failed = [c["name"] for c in checks if c["status"] == "failed"]
        extra = f"; checks: {len(checks)}, failed: {failed}" if checks else ""
        print(f"{e['name']:<16} {e['status']:<24} {e['seconds']:>8.1f} s{extra}")
    print(f"summary: {counts} -> {out / 'summary.json'}")
    return 1 if counts["failed"] else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["step"]:
        head, command = (argv[1:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv[1:], [])
        out, name, status, code, seconds, log, *result = head
        record(Path(out), name, status, code, seconds, log, result[0] if result else None, command)
        return 0
    if argv[:1] == ["collect"]:
        return collect(Path(argv[1]), argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
