"""skyrl-sdk: turn any Hugging Face causal LM into a Tinker-compatible training backend."""

from __future__ import annotations

__version__ = "0.1.0"

from . import errors, types  # noqa: E402
from .hookspecs import hookimpl  # noqa: E402


def __getattr__(name: str):
    # Backend pulls in torch + transformers; import it lazily so `import skyrl_sdk` stays cheap.
    if name == "Backend":
        from .backend import Backend

        return Backend
    raise AttributeError(name)


__all__ = ["Backend", "errors", "hookimpl", "types", "__version__"]
