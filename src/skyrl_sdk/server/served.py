"""The base models this server serves: which names resolve to them, how long a sequence each
accepts, and how a Backend for one is built."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..types import LoraConfig
from .config import ServerConfig

#: torch's default RNG is process-wide: model initialisation (``tiny``, LoRA adapters) and
#: sampling seed and draw from it, so those run one at a time across all workers (or two
#: models created at once would get interleaved draws). Training draws no random numbers
#: and runs concurrently.
RNG_LOCK = threading.RLock()

#: config.json keys that give a model's position limit, in the order they are tried
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _canonical(name: str) -> str:
    if name == "tiny":
        return name
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name.rstrip("/")


def position_limit(model: str) -> int | None:
    """The model's ``max_position_embeddings`` (or equivalent) from its config.json, if any."""
    from ..models import TINY_DIR

    directory = TINY_DIR if model == "tiny" else Path(model).expanduser()
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in _POSITION_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class ServedModels:
    """``--model`` entries, each with its sequence-length limit (``--max-seq-len`` caps all)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._by_canonical = {_canonical(m): m for m in config.models}
        self._limits: dict[str, int | None] = {}
        for m in config.models:
            limits = [v for v in (position_limit(m), config.max_seq_len) if v is not None]
            self._limits[m] = min(limits) if limits else None

    def resolve(self, name: Any) -> str:
        """The ``--model`` entry a client's ``base_model`` names."""
        if not isinstance(name, str) or not name:
            raise InputError(f"base_model: expected a model name, got {name!r}")
        found = self._by_canonical.get(_canonical(name))
        if found is None:
            raise InputError(f"base model {name!r} is not served here; this server serves {list(self.config.models)}")
        return found

    def max_seq_len(self, base_model: str | None) -> int | None:
        """Longest sequence (prompt + completion, or one datum) accepted for ``base_model``."""
        if base_model is None:
            return self.config.max_seq_len
        return self._limits.get(base_model, self.config.max_seq_len)

    def open_backend(self, base_model: str, lora: LoraConfig | None):
        """A new Backend for a served model (holding the RNG lock while it initialises)."""
        from ..backend import Backend

        with RNG_LOCK:
            return Backend(model=base_model, engine=self.config.engine, engine_config=self.config.engine_config,
                           lora=lora, seed=self.config.seed)
