"""nn.Modules that engines run: an HF model plus target-logprob (or value) scoring.

Scoring lives *inside* one root module so that wrappers such as FSDP2, whose root hooks
gather the embedding / lm_head shards, see a single forward call.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import prefix_attention
from .loading import hf_model
from .logprobs import CHUNK_THRESHOLD_ELEMENTS, target_logprobs
from .prefix import PrefixPlan
from .vlm import is_vision_language, text_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def backbone_of(model: nn.Module) -> PreTrainedModel:
    """The decoder stack of ``model`` (a causal LM, a critic or a peft wrapper of either): what
    computes hidden states, without the output head."""
    inner = hf_model(model)
    return getattr(inner, inner.base_model_prefix)


class Head:
    """The output projection with the model family's logit post-processing.

    A plain callable, not a submodule: the projection is already registered under the HF
    model, and registering it twice would duplicate it in state dicts and FSDP groups.
    """

    def __init__(self, proj: nn.Module, config: PretrainedConfig) -> None:
        self.proj = proj
        config = text_config(config)
        self.scale = getattr(config, "logit_scale", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.proj(h)
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits.float() / self.softcap) * self.softcap
        return logits


class ScoringModel(nn.Module):
    """Runs the backbone once and scores only the real tokens of a micro-batch.

    ``forward`` returns ``(scores, entropy)``: the scores are a policy's target logprobs
    (with their entropy) or a critic's values (entropy ``None``), of shape (T,) over
    ``flat_index``; :func:`~skyrl_sdk.engines.base.scores_key` names them per role.

    With a ``prefix`` plan the row is a shared-prefix row (:mod:`.prefix`): ``flat_index``
    repeats the prefix slots once per datum, and the head runs once per distinct (slot,
    target) pair, its results repeated (the samples of a group have the same hidden state and
    the same next token all along their prompt).

    A vision-language model's micro-batch brings its images (``pixel_values``, ``image_grid_thw``)
    and M-RoPE ``position_ids`` of shape (3, rows, length), or (4, 1, length) for a packed row
    (the first row: each datum's text positions, which tell attention where datums start).
    """

    #: set in ``__dict__``, not as a submodule (see Head)
    head: Head

    def __init__(self, model: nn.Module, role: str) -> None:
        super().__init__()
        self.model = model
        self.role = role
        inner = hf_model(model)
        self.vocab_size = int(text_config(inner.config).vocab_size)
        #: a vision-language model: positions are M-RoPE (engines/batching.py builds them)
        self.vision_language = is_vision_language(inner.config)
        proj = inner.value_head if role == "critic" else inner.get_output_embeddings()
        self.__dict__["head"] = Head(proj, inner.config)  # not a submodule (see Head)
        self.chunk_elements = CHUNK_THRESHOLD_ELEMENTS
        #: A causal LM never lets a token see later positions, so right padding cannot reach
        #: the real tokens and the padding mask can be dropped (attention then takes its
        #: causal fast path). Critics may be bidirectional encoders: they keep the mask.
        self.drop_right_padding_mask = role == "policy"

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        flat_index: torch.Tensor,
        targets: torch.Tensor | None,
        want_entropy: bool = True,
        prefix: PrefixPlan | None = None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if prefix is not None:
            hidden = prefix_attention.shared_hidden(backbone_of(self.model), input_ids, position_ids, prefix)
            if self.role == "policy" and targets is not None and targets.dim() == 1:
                return self._deduplicated_logprobs(hidden, flat_index, targets, want_entropy)
            hidden = hidden.index_select(0, flat_index)  # repeats the prefix slots once per datum
        else:
            padded_rows = position_ids is None or self.vision_language
            if attention_mask is not None and padded_rows and self.drop_right_padding_mask:
                attention_mask = None  # rows are right-padded (batching.py); outputs at padding are dropped
            pixels = {} if images is None else {"pixel_values": images[0], "image_grid_thw": images[1]}
            out = backbone_of(self.model)(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                **pixels,
            )
            hidden = out.last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1])
            if flat_index.shape[0] != hidden.shape[0]:  # equal: no padding, flat_index is arange
                hidden = hidden.index_select(0, flat_index)
        if self.role == "critic":
            return self.head.proj(hidden).squeeze(-1).float(), None
        if targets is None:
            raise ValueError("ScoringModel.forward: a policy scores targets; got targets=None")
        return target_logprobs(
            hidden, self.head, targets, self.vocab_size, want_entropy=want_entropy, chunk_elements=self.chunk_elements
        )

    def _deduplicated_logprobs(self, hidden: torch.Tensor, flat_index: torch.Tensor, targets: torch.Tensor,
                               want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A shared row's logprobs with the head run once per distinct (slot, target) pair: the
        samples of a group share the prompt's hidden states and next tokens (top-K targets,
        rows of K, are not deduplicated)."""
        pairs, inverse = torch.unique(flat_index * self.vocab_size + targets, return_inverse=True)
        slots = torch.div(pairs, self.vocab_size, rounding_mode="floor")
        lp, entropy = target_logprobs(hidden.index_select(0, slots), self.head, pairs - slots * self.vocab_size,
                                      self.vocab_size, want_entropy=want_entropy, chunk_elements=self.chunk_elements)
        return lp.index_select(0, inverse), None if entropy is None else entropy.index_select(0, inverse)


def count_parameters(module: nn.Module) -> tuple[int, int]:
    total = trainable = 0
    seen = set()
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = math.prod(p.shape)
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable
