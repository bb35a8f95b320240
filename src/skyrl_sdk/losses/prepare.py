"""Whole-call statistics for losses with a ``prepare`` step (e.g. clip_cov's token selection).

``prepare`` must see every token of the call at once, before micro-batching or a rank split
could hide part of it; its per-token results then travel with the datums as extra inputs,
so every micro-batch and rank scores exactly what one big batch would have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..types import Datum
from .base import LossInput, scores_key
from .resolve import ResolvedLoss


def add_prepared_inputs(
    datums: Sequence[Datum], resolved: ResolvedLoss, outputs: Sequence[Mapping[str, np.ndarray]]
) -> list[Datum]:
    """Pack the call, run ``resolved.spec.prepare`` on it, and split its results per datum.

    ``outputs`` are the per-datum results of a no-grad pass over ``datums`` (``logprobs`` for
    a policy, ``values`` for a critic).
    """
    role = resolved.spec.role
    lengths = [d.model_input.length for d in datums]
    scores = torch.from_numpy(np.concatenate([o[scores_key(role)] for o in outputs]))
    inputs = {
        k: torch.from_numpy(np.concatenate([d.loss_fn_inputs[k].array for d in datums]))
        for k in datums[0].loss_fn_inputs
    }
    segment_ids = torch.from_numpy(np.repeat(np.arange(len(datums)), lengths))
    packed = LossInput.for_role(role, scores, inputs=inputs, segment_ids=segment_ids, num_segments=len(datums))
    extra = resolved.spec.prepare(packed, resolved.config)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [
        Datum(
            model_input=d.model_input,
            loss_fn_inputs={**d.loss_fn_inputs,
                            **{k: v.detach().cpu().numpy()[bounds[i]:bounds[i + 1]] for k, v in extra.items()}},
        )
        for i, d in enumerate(datums)
    ]
