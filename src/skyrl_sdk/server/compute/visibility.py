"""What ``GET /api/v1/loaded`` shows each caller: an owner sees only their own models, an
operator everyone's, and nobody a path of the server's file system.

Before: every caller saw every own copy's model as the server named it, which for a sampler of
an exported checkpoint is the absolute path of that checkpoint (another owner's checkpoint name
included), and every adapter's row (its id hidden, its rank, step and size not). docs/server.md
promises that another owner's things read like things that do not exist and that answers never
show the server's file system, so: adapters and own copies are listed only to their owner (and
to operators), and a copy's model is a served model's name or a ``tinker://`` path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any


def _owners_of_backends(models: Iterable[Any], targets: Iterable[Any]) -> dict[int, tuple[str, str | None]]:
    """id(backend) -> (owner, model id or None) for every Backend a client's request made."""
    out: dict[int, tuple[str, str | None]] = {}
    for model in list(models):
        if model.backend is not None:
            out[id(model.backend)] = (model.owner, model.model_id)
    for target in targets:
        if target.backend is not None:
            out[id(target.backend)] = (target.owner, None)
    return out


def loaded(doc: dict[str, Any], owner: str, operator: bool, models: Mapping[str, Any], targets: Iterable[Any],
           redact: Callable[[str], str]) -> dict[str, Any]:
    """``/api/v1/loaded`` for ``owner`` from what is loaded (``doc``: ``ServedModels.loaded(with_backends=True)``):
    the bases (the shared weights and their totals), the adapters and own copies the caller may
    see. ``models``: the training models by id; ``targets``: the sampler Backends' targets."""
    for base in doc["bases"]:
        rows = []
        for row in base["adapters"]:
            model = models.get(row["label"])
            mine = model is not None and model.owner == owner
            if mine or operator:
                rows.append({"model_id": row["label"] if model is not None else None,
                             **({"owner": model.owner if model is not None else None} if operator else {}),
                             **{k: v for k, v in row.items() if k not in ("label", "adapter")}})
        base["adapters"] = rows
    owners = _owners_of_backends(models.values(), targets)
    copies = []
    for copy in doc["own_copies"]:
        who, model_id = owners.get(id(copy.pop("backend")), (None, None))
        if who == owner or operator:
            copies.append({**copy, "model": redact(str(copy["model"])), "model_id": model_id,
                           **({"owner": who} if operator else {})})
    doc["own_copies"] = copies
    return doc
