"""The ``skyrl-sdk`` command: :mod:`.commands` (the parser and the small commands), :mod:`.demo`
(``skyrl-sdk demo``) and :mod:`.serve` (``skyrl-sdk serve``: checks, bind, banner)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The console script's entry (``skyrl-sdk``); imports the parser only when run."""
    from .commands import main as run

    return run(argv)
