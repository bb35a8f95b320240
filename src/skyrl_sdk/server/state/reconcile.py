"""Start-up reconciliation of checkpoint directories that have no record.

A save that died between writing its directory and recording it, or a state dir copied
without its database, leaves such a directory; left alone it blocks its name forever (a save
refuses to replace it, a load finds no record). A complete checkpoint (written by a save of
ours) of a known run is adopted; anything else is moved to ``<state-dir>/quarantine/``.

Never fatal: one entry that cannot be read or moved is logged and skipped, so no name under
``runs/`` can stop a start (a 250-character name used to: its quarantine name, the name plus
a time stamp, passed the file system's 255-byte limit, and the start aborted on every restart).
Quarantine names are short and hashed: ``<first 40 safe characters>-<hash of the path>-<time>``,
the original path named in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from ...models.checkpoint import is_checkpoint_dir

logger = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def short_name(name: str, path: str) -> str:
    """A file name of at most ~70 bytes for ``name`` (found at ``path``), unique per path and time."""
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:12]
    return f"{_UNSAFE.sub('_', name)[:40].lstrip('.') or 'entry'}-{digest}-{int(time.time())}"


def reconcile_checkpoints(root: Path, segments: dict[str, str], valid_name: re.Pattern,
                          run_id_of: Callable[[str], str | None], recorded: set[tuple[str, str, str]],
                          adopt: Callable[[str, str, str, float], str]) -> tuple[list[str], list[str]]:
    """Adopt or quarantine every unrecorded entry under ``<root>/runs/<run>/<segment>/``.

    ``run_id_of(dirname)``: the known run of a run directory (or None); ``recorded``: the
    (run id, kind, name) of every recorded checkpoint; ``adopt(run_id, kind, name, mtime)``
    records one and returns its ``tinker://`` path. Returns (adopted tinker paths, quarantined
    directories relative to ``root``)."""
    adopted: list[str] = []
    quarantined: list[str] = []
    for run_dir in _entries(root / "runs"):
        try:
            run_id = run_id_of(run_dir.name) if run_dir.is_dir() and not run_dir.is_symlink() else None
        except (OSError, ValueError):
            run_id = None
        for segment, kind in segments.items():
            folder = run_dir / segment
            try:
                if run_dir.is_symlink() or folder.is_symlink() or not folder.is_dir():
                    continue
            except OSError:
                continue
            for entry in _entries(folder):
                if entry.name.startswith(".") or (run_id, kind, entry.name) in recorded:
                    continue  # a save in progress (or its leftovers, cleaned elsewhere), or recorded
                try:
                    if run_id is not None and valid_name.fullmatch(entry.name) and is_checkpoint_dir(entry):
                        adopted.append(adopt(run_id, kind, entry.name, entry.stat().st_mtime))
                        continue
                    where = str(entry.relative_to(root))
                    target = root / "quarantine" / short_name(entry.name, where)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(entry, target)
                    quarantined.append(str(target.relative_to(root)))
                    logger.warning("moved %r (no record, not a complete checkpoint of a known run) to %s",
                                   where, quarantined[-1])
                except Exception as exc:  # one entry never stops the start
                    logger.warning("could not reconcile %r under the state dir (left as it is): %s: %s",
                                   str(entry)[-300:], type(exc).__name__, exc)
    if adopted:
        logger.warning("adopted %d checkpoint directories that had no record (a save interrupted before it was "
                       "recorded): %s", len(adopted), ", ".join(adopted))
    if quarantined:
        logger.warning("moved %d checkpoint directories without a record that are not complete checkpoints of a "
                       "known run to <state-dir>/quarantine", len(quarantined))
    return adopted, quarantined


def _entries(folder: Path) -> list[Path]:
    """The entries of ``folder``, sorted; none when it cannot be read (logged)."""
    try:
        return sorted(folder.iterdir())
    except OSError as exc:
        logger.warning("could not list %s under the state dir (skipped): %s", folder.name[-100:], exc.strerror)
        return []
