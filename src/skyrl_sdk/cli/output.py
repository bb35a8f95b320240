"""What the commands print: one JSON document (``--json``: machines read stdout, logs and
warnings go to stderr) or left-aligned columns for a person."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def print_json(doc: Any) -> None:
    # repr() keeps odd values (e.g. an enum config default) printable instead of crashing.
    print(json.dumps(doc, indent=2, sort_keys=False, default=repr))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Left-aligned columns, two spaces apart; the last column is not padded."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)] + [str(row[-1])]
        print("  ".join(cells).rstrip())
