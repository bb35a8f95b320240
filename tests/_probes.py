"""Probe counts of the hardening suites (issue 9): probes tried / handled, by group.

A suite makes one :class:`Probes`, marks each probe ``tried`` before it and ``handled`` once
every check on it passed (optionally with an outcome such as ``"accepted"``), asserts its
counts, and installs :meth:`Probes.report_fixture` so that its counts are merged into the
JSON file named by ``$SKYRL_PROBE_REPORT`` (when set) at the end of the module::

    SKYRL_PROBE_REPORT=/tmp/probes.json pytest tests/test_fuzz_inputs.py tests/test_checkpoint_save.py \\
        tests/test_server_security.py && python tests/_probes.py /tmp/probes.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ENV = "SKYRL_PROBE_REPORT"


class Probes:
    """Counts of one suite: ``{group: {"tried": n, "handled": n, <outcome>: n, ...}}``."""

    def __init__(self, suite: str) -> None:
        self.suite = suite
        self.counts: dict[str, dict[str, int]] = {}

    def _row(self, group: str) -> dict[str, int]:
        return self.counts.setdefault(group, {"tried": 0, "handled": 0})

    def tried(self, group: str) -> None:
        self._row(group)["tried"] += 1

    def handled(self, group: str, outcome: str | None = None) -> None:
        row = self._row(group)
        row["handled"] += 1
        if outcome is not None:
            row[outcome] = row.get(outcome, 0) + 1
        assert row["handled"] <= row["tried"], f"{self.suite}/{group}: handled a probe never tried"

    def of(self, group: str) -> tuple[int, int]:
        """``(tried, handled)`` of ``group`` so far."""
        row = self.counts.get(group, {"tried": 0, "handled": 0})
        return row["tried"], row["handled"]

    def write(self, path: str | os.PathLike | None = None) -> None:
        """Merge this suite's counts into the report file (``$SKYRL_PROBE_REPORT``; none: nothing)."""
        path = path or os.environ.get(ENV)
        if not path or not self.counts:
            return
        path = Path(path)
        report = json.loads(path.read_text()) if path.is_file() else {}
        report[self.suite] = self.counts
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, sort_keys=True))
        os.replace(tmp, path)

    def report_fixture(self):
        """A module-scoped autouse fixture that writes the counts when the module's tests end."""

        @pytest.fixture(scope="module", autouse=True)
        def _write_probe_report():
            yield
            self.write()

        return _write_probe_report


def table(report: dict) -> str:
    """The report as a Markdown table: suite, group, tried, handled (and outcomes)."""
    lines = ["| suite | group | tried | handled | outcomes |", "|---|---|---|---|---|"]
    for suite, groups in report.items():
        for group, row in groups.items():
            extra = ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("tried", "handled"))
            lines.append(f"| {suite} | {group} | {row['tried']} | {row['handled']} | {extra} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else os.environ[ENV]).read_text())))
