"""External weights (``save_weights_external``) and the signed links that download them.

An export is a checkpoint of kind ``external`` (``tinker://<run>/external_weights/<name>``):
a Hugging Face model directory that ``transformers`` loads as it is (``config.json``,
safetensors, tokenizer; a LoRA run's adapter merged in), and for a LoRA run also its peft
adapter in ``adapter/`` (``PeftModel.from_pretrained(base, <dir>/adapter)``). With
``age_encryption_recipients`` every file is age-encrypted to them and stored with a ``.age``
suffix, as Tinker does (what the cookbook's ``weights.download`` asks for a training
checkpoint, decrypting with a key it generated).

:class:`DownloadLinks` signs links to an export's files: unguessable tokens that expire after
:data:`LINK_TTL_S`, each naming one checkpoint directory, served without an API key (the
client fetches them with ``urllib``), only the files the listing named.
"""

from __future__ import annotations

import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import attrs

from ...errors import InputError, NotFoundError, install_hint
from ...models.checkpoint import atomic_directory
from ..wire.tinker_paths import iso

#: how long a signed download link works
LINK_TTL_S = 3600.0
#: most age recipients one export may name (Tinker's bound)
MAX_RECIPIENTS = 10
AGE_SUFFIX = ".age"


def age_recipients(values: Any) -> list[Any] | None:
    """``age_encryption_recipients`` as pyrage recipients (native ``age1...`` or SSH public
    keys); an InputError names a bad one."""
    if values is None:
        return None
    if not isinstance(values, list) or not 1 <= len(values) <= MAX_RECIPIENTS \
            or not all(isinstance(v, str) for v in values):
        raise InputError(f"age_encryption_recipients: expected a list of 1 to {MAX_RECIPIENTS} recipient strings, "
                         f"got {values!r:.200}")
    try:
        import pyrage
    except ImportError:
        raise InputError("age_encryption_recipients: this server cannot encrypt (the pyrage package is not "
                         f"installed: {install_hint('server')})") from None
    out = []
    for i, value in enumerate(values):
        kind = pyrage.ssh if value.startswith(("ssh-", "ecdsa-")) else pyrage.x25519
        try:
            out.append(kind.Recipient.from_str(value.strip()))
        except pyrage.RecipientError as exc:
            raise InputError(f"age_encryption_recipients[{i}]: not an age or SSH public key ({exc})") from None
    return out


def public_files(directory: Path) -> list[str]:
    """The files of an export, relative paths (the checkpoint's own marker files left out)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and not p.is_symlink() and not any(part.startswith(".")
                                                                     for part in p.relative_to(directory).parts))


def export_external(backend: Any, lora: bool, directory: Path, scratch: Path, recipients: list[Any] | None) -> None:
    """Write ``backend``'s weights as an external export at ``directory`` (atomically;
    ``scratch`` is a fresh working directory, removed afterwards)."""
    try:
        backend.save_weights_for_sampler(scratch / "model", merge_lora=True)
        if lora:
            backend.save_weights_for_sampler(scratch / "adapter", merge_lora=False)
        with atomic_directory(directory, overwrite=True) as tmp:
            parts = [("model", tmp)] + ([("adapter", tmp / "adapter")] if lora else [])
            for source, target in parts:
                for name in public_files(scratch / source):
                    destination = target / name
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    if recipients is None:
                        shutil.move(str(scratch / source / name), destination)
                    else:
                        import pyrage

                        pyrage.encrypt_file(str(scratch / source / name), str(destination) + AGE_SUFFIX, recipients)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@attrs.frozen
class _Link:
    directory: Path
    files: frozenset[str]
    expires: float


class DownloadLinks:
    """Signed, expiring links to the files of a checkpoint directory (thread-safe)."""

    def __init__(self, ttl_s: float = LINK_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()

    def sign(self, directory: Path, base_url: str) -> dict[str, Any]:
        """``{"urls": {file: url}, "expires": iso}`` for every file of ``directory``."""
        files = public_files(directory)
        token = secrets.token_urlsafe(32)
        now = time.time()
        with self._lock:
            for old in [t for t, link in self._links.items() if link.expires <= now]:
                del self._links[old]
            self._links[token] = _Link(directory, frozenset(files), now + self.ttl_s)
        base = base_url.rstrip("/")
        return {"urls": {f: f"{base}/api/v1/downloads/{token}/{f}" for f in files}, "expires": iso(now + self.ttl_s)}

    def file(self, token: str, name: str) -> Path:
        """The file a link names; NotFoundError for an unknown or expired link or another file."""
        with self._lock:
            link = self._links.get(token)
        if link is None or link.expires <= time.time() or name not in link.files:
            raise NotFoundError("unknown or expired download link: ask for new ones "
                                "(RestClient.get_external_weights_urls)")
        path = link.directory / name
        if not path.is_file():
            raise NotFoundError("this file is gone: its checkpoint was deleted or expired")
        return path
