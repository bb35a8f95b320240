"""The sequences sampled with ``record_stability_info`` (``stable_reinforce``'s provenance), per
client session and bounded per owner.

Tinker's provenance names sequences of the datum's own session, so each session gets its own
view (:class:`~skyrl_sdk.losses.stability.ScopedRecords`); all of an owner's sessions share one
:class:`~skyrl_sdk.losses.stability.SequenceRecords`, so ``max_recorded_bytes`` bounds the owner
however many sessions it opens. A session's sequences are dropped when it ends, and a sample
of it that finishes afterwards records nothing.
"""

from __future__ import annotations

from ...losses.stability import ScopedRecords, SequenceRecords


class RecordedSequences:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        #: per owner, the records of all its sessions
        self.owners: dict[str, SequenceRecords] = {}
        #: per open client session, its view of its owner's records
        self.sessions: dict[str, ScopedRecords] = {}

    def of(self, owner: str, session_id: str) -> ScopedRecords:
        """The recorded sequences of ``owner``'s session ``session_id``."""
        view = self.sessions.get(session_id)
        if view is None:
            shared = self.owners.get(owner)
            if shared is None:
                shared = self.owners[owner] = SequenceRecords(max_bytes=self.max_bytes)
            view = self.sessions[session_id] = shared.scope(session_id)
        return view

    def end(self, session_id: str) -> None:
        """(the session finished or expired) Drop its sequences; it records none again."""
        if (view := self.sessions.pop(session_id, None)) is not None:
            view.close()
