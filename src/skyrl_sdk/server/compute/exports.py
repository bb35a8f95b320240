"""External weights (``save_weights_external``) and the signed links that download them.

An export is a checkpoint of kind ``external`` (``tinker://<run>/external_weights/<name>``):
a Hugging Face model directory that ``transformers`` loads as it is (``config.json``,
safetensors, tokenizer; a LoRA run's adapter merged in), and for a LoRA run also its peft
adapter in ``adapter/`` (``PeftModel.from_pretrained(base, <dir>/adapter)``). With
``age_encryption_recipients`` every file is age-encrypted to them and stored with a ``.age``
suffix, as Tinker does (what the cookbook's ``weights.download`` asks for a training
checkpoint, decrypting with a key it generated).

:class:`DownloadLinks` signs links to an export's files, served without an API key (the
client fetches them with ``urllib``): the token in the link is the credential, an HMAC of
what it names (owner, checkpoint, the checkpoint's creation time, the link's expiry) under
a key of this process. Stateless: signing keeps nothing in memory (links cost the server no
memory however many are asked for), and a link stops working when it expires
(:data:`LINK_TTL_S`), when the server restarts, and as soon as its checkpoint is gone from
the catalog: deleted, expired, or deleted and exported again under the same name (the new
export's creation time differs, so an old link never serves new content).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import shutil
import time
from collections.abc import Callable
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
class LinkTarget:
    """What a link names: ``owner``'s live export ``path`` (a ``tinker://`` path) as created at
    ``created`` (its catalog record's time), its ``directory`` and public ``files``."""

    owner: str
    path: str
    created: str
    directory: Path
    files: tuple[str, ...]


#: bytes of a link's MAC (HMAC-SHA256, truncated: 144 bits)
_MAC_BYTES = 18


class DownloadLinks:
    """Signed, expiring, stateless links to the files of an export (see the module docstring).
    ``lookup(owner, path)`` gives the live checkpoint's catalog record (None once deleted or
    expired) and ``directory(path)`` its directory; both run where :meth:`file` runs (off the
    event loop)."""

    def __init__(self, lookup: Callable[[str, str], dict[str, Any] | None], directory: Callable[[str], Path],
                 ttl_s: float = LINK_TTL_S) -> None:
        self.lookup, self.directory, self.ttl_s = lookup, directory, ttl_s
        self._key = secrets.token_bytes(32)

    def sign(self, target: LinkTarget, base_url: str) -> dict[str, Any]:
        """``{"urls": {file: url}, "expires": iso}`` for every file of ``target``."""
        expires = int(time.time() + self.ttl_s)
        payload = json.dumps([target.owner, target.path, target.created, expires], separators=(",", ":")).encode()
        token = f"{_b64(payload)}.{_b64(self._mac(payload))}"
        base = base_url.rstrip("/")
        return {"urls": {f: f"{base}/api/v1/downloads/{token}/{f}" for f in target.files}, "expires": iso(expires)}

    def file(self, token: str, name: str) -> Path:
        """(off the event loop) The file a link names; NotFoundError for a forged, expired or
        stale link (its checkpoint deleted, expired or re-created) or a file it does not name."""
        owner, path, created, expires = self._verified(token)
        if expires <= time.time():
            raise NotFoundError("this download link has expired: ask for new ones "
                                "(RestClient.get_external_weights_urls)")
        record = self.lookup(owner, path)
        if record is None or record["time"] != created:
            raise NotFoundError("this download link's checkpoint was deleted, expired or re-created since the link "
                                "was signed: ask for new links (RestClient.get_external_weights_urls)")
        directory = self.directory(path)
        if name not in public_files(directory):
            raise NotFoundError("this download link names no such file")
        return directory / name

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()[:_MAC_BYTES]

    def _verified(self, token: str) -> tuple[str, str, str, int]:
        """What a token of this process names; NotFoundError for any other token."""
        payload_b64, _, mac_b64 = token.partition(".")
        try:
            payload, mac = _unb64(payload_b64), _unb64(mac_b64)
        except ValueError:
            payload, mac = b"", b""
        if not mac or not hmac.compare_digest(mac, self._mac(payload)):
            raise NotFoundError("unknown or expired download link: ask for new ones "
                                "(RestClient.get_external_weights_urls)")
        owner, path, created, expires = json.loads(payload)  # signed by this process: its own shape
        return owner, path, created, expires


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    """base64url without padding; ValueError for anything else (or anything long)."""
    if len(text) > 4096:
        raise ValueError("token too long")
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
