"""Fault injection in a server's SQLite file through SQLite itself: a trigger, added from a
connection of the test's own, makes the server's next matching statement fail (as a full disk
or a crash at that moment would), with no reach into the server's objects."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def failing(db: Path | str, event: str, table: str) -> Iterator[None]:
    """Every ``event`` (INSERT, UPDATE or DELETE) on ``table`` fails inside the block with
    ``sqlite3.IntegrityError: injected failure``; the trigger is dropped at the end."""
    name = f"test_fail_{event.lower()}_{table}"
    with contextlib.closing(sqlite3.connect(str(db), isolation_level=None)) as c:
        c.execute(f"CREATE TRIGGER {name} BEFORE {event} ON {table} BEGIN SELECT RAISE(ABORT, 'injected failure'); END")
    try:
        yield
    finally:
        with contextlib.closing(sqlite3.connect(str(db), isolation_level=None)) as c:
            c.execute(f"DROP TRIGGER IF EXISTS {name}")


def column(db: Path | str, sql: str, params: tuple = ()) -> list:
    """The first column of ``sql``'s rows, read on a connection of the test's own."""
    with contextlib.closing(sqlite3.connect(str(db))) as c:
        return [r[0] for r in c.execute(sql, params)]
