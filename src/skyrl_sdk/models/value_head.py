"""The critic: a causal LM's own backbone (decoder stack) and a linear value head.

Any architecture the policy supports has a backbone (``AutoModel``), so any of them can be a
critic; no ``...ForTokenClassification`` class is needed. The backbone is kept under the
causal LM's attribute name (``base_model_prefix``, ``model`` for Llama-like families), so
its weights carry the causal-LM checkpoint's names; the head is ``value_head.weight`` (1, H)
and ``value_head.bias`` (1,).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

VALUE_HEAD = "value_head"
#: config.json field an exported critic carries: the name of its value head's weights.
CONFIG_FIELD = "skyrl_value_head"


class ValueHeadModel(nn.Module):
    """Backbone -> last hidden state -> ``value_head`` (one scalar per token)."""

    config: PretrainedConfig

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.base_model_prefix = getattr(backbone, "base_model_prefix", "") or "model"
        setattr(self, self.base_model_prefix, backbone)
        self.config = backbone.config
        setattr(self.config, CONFIG_FIELD, VALUE_HEAD)  # an export says where its head is
        self._no_split_modules = list(getattr(backbone, "_no_split_modules", None) or [])
        self.value_head = nn.Linear(int(self.config.get_text_config().hidden_size), 1, bias=True)

    @property
    def backbone(self) -> PreTrainedModel:
        return getattr(self, self.base_model_prefix)

    @property
    def export_architecture(self) -> str:
        """What an export's ``config.architectures`` names: the backbone, loadable by ``AutoModel``."""
        return type(self.backbone).__name__

    def get_output_embeddings(self) -> None:
        return None

    def get_input_embeddings(self) -> nn.Module:
        return self.backbone.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **kwargs)
        return self.value_head(out.last_hidden_state).squeeze(-1)


#: Standard deviation of a new head's weights: small, so an untrained critic predicts about
#: 0 (a random head of the usual 0.02 made the first full-fine-tuning steps overshoot on the
#: tiny model), not exactly 0 (so that advantages computed from it are never all zero).
INIT_STD = 1e-3


def initial_value_head(hidden_size: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A new head's weights, from its own seeded generator: equal on every engine and rank."""
    gen = torch.Generator().manual_seed(int(seed))
    weight = torch.empty(1, hidden_size).normal_(0.0, INIT_STD, generator=gen)
    return {f"{VALUE_HEAD}.weight": weight.to(dtype), f"{VALUE_HEAD}.bias": torch.zeros(1, dtype=dtype)}


#: The file a critic's export carries that says what it is (the model-card name on the Hub).
CRITIC_CARD = "README.md"


def critic_export_note(what: str | Path) -> str:
    """What a critic's ``save_weights_for_sampler`` wrote (``what``: its path, or "This
    directory") and how to load it, warned and written beside the weights: a causal-LM loader
    would give it a random lm_head."""
    return (f"{what} is a critic (value model) export: its backbone and value head, no lm_head, so it is "
            f"not a model to sample from. Load it with skyrl_sdk.Backend(model=..., role='critic'), or the "
            f"backbone alone with transformers' AutoModel; AutoModelForCausalLM (or vLLM) would load it with "
            f"a random lm_head")


def write_critic_card(directory: Path) -> None:
    """``README.md`` in a critic's export: what the files are, how to load them."""
    (directory / CRITIC_CARD).write_text(
        "# A skyrl-sdk critic (value model)\n\n"
        f"{critic_export_note('This directory')}.\n\n"
        f"The value head is `{VALUE_HEAD}.weight` (1, hidden) and `{VALUE_HEAD}.bias` (1,): last hidden "
        "state -> one value per token. The layout: skyrl-sdk's docs/engines.md, \"The critic\".\n"
    )
