"""What calls return: typed, frozen results that carry metrics."""

from __future__ import annotations

from typing import Literal

import attrs
import numpy as np

from .tensor import TensorData


@attrs.frozen(eq=False)
class SampledSequence:
    """One generated continuation."""

    #: The generated token ids (the prompt excluded).
    tokens: list[int]
    #: Log-probability of each generated token under the model (temperature 1, unfiltered).
    logprobs: list[float]
    #: ``"stop"`` (a stop token or string ended it) or ``"length"`` (max_tokens reached).
    stop_reason: Literal["stop", "length"]
    #: Names this sequence in a training datum's provenance, when it was sampled with
    #: ``record_stability_info=True`` (None otherwise).
    sequence_id: str | None = None
    #: Per generated position, the k most likely ``(token_id, logprob)`` pairs of the
    #: distribution the token was drawn from (temperature 1), most likely first, if
    #: ``topk_sample_logprobs=k`` was asked (Tinker's ``SampledSequence.topk_logprobs``).
    topk_logprobs: list[list[tuple[int, float]]] | None = None


@attrs.frozen(eq=False)
class PromptAltTokens:
    """``k`` draws, with replacement and at the request's temperature, from the model's
    next-token distribution at every prompt position after the first (Tinker's field)."""

    #: int64 token ids, shape ``[len(prompt) - 1, k]``: row ``i`` holds alternatives to ``prompt[i + 1]``.
    tokens: np.ndarray
    #: float32 model logprobs (temperature 1) of ``tokens``, same shape.
    logprobs: np.ndarray


@attrs.frozen(eq=False)
class SampleOutput:
    """The samples of one prompt."""

    #: ``num_samples`` continuations.
    sequences: list[SampledSequence]
    #: Log-probability of each prompt token given the ones before (None for the first), if asked.
    prompt_logprobs: list[float | None] | None = None
    #: Per prompt position, the k most likely ``(token_id, logprob)`` pairs, most likely first
    #: (None for the first position), if ``topk_prompt_logprobs=k`` was asked (Tinker's field).
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    #: float32 ``[len(prompt) - 1, K]``: the logprob at prompt position ``i + 1`` of the token
    #: id in cell ``[i, j]`` of the request's ``target_prompt_logprobs`` (0.0 where it had -1).
    target_prompt_logprobs: np.ndarray | None = None
    #: The draws ``prompt_alt_tokens_k`` asked for.
    prompt_alt_tokens: PromptAltTokens | None = None
    #: The call's throughput (the same dict on every output of one call): ``tokens_per_second:mean``
    #: (sampled tokens), ``seconds:sum``, ``sampled_tokens:sum``, ``prompt_tokens:sum`` and, where the
    #: device's peak is known, ``mfu:mean`` (docs/performance.md, Throughput metrics). None: not set.
    metrics: dict[str, float] | None = None


@attrs.frozen(eq=False)
class ForwardBackwardOutput:
    """Result of forward / forward_backward."""

    #: Tinker's output type tag (``"ArrayRecord"``).
    loss_fn_output_type: str
    #: Per datum, in the caller's order: output name (``logprobs``, ``elementwise_loss``, ...) -> tensor.
    loss_fn_outputs: list[dict[str, TensorData]]
    #: ``name:reduction`` -> value, reduced over the whole call (see docs/losses.md).
    metrics: dict[str, float]


@attrs.frozen
class OptimStepOutput:
    """Result of optim_step."""

    #: ``grad_norm``, ``learning_rate``, ``skipped``, ``step``, ... (see docs/backend.md).
    metrics: dict[str, float]


@attrs.frozen
class SaveWeightsForSamplerOutput:
    """Result of save_weights_for_sampler."""

    #: Absolute path of the Hugging Face model directory written.
    path: str


@attrs.frozen
class SaveStateOutput:
    """Result of save_state."""

    #: Absolute path of the checkpoint directory written.
    path: str


@attrs.frozen
class LoadStateOutput:
    """Result of load_state."""

    #: Absolute path of the checkpoint directory read.
    path: str
    #: Whether the optimizer moments and step counts were loaded too.
    optimizer_loaded: bool


@attrs.frozen
class ModelInfo:
    """What get_info reports about a Backend's model."""

    #: The ``model`` the Backend was created with (``tiny`` or a directory).
    model_name: str
    #: The transformers architecture class name.
    architecture: str
    #: Size of the model's output vocabulary.
    vocab_size: int
    #: Directory of the tokenizer, or None.
    tokenizer_dir: str | None
    #: Whether LoRA adapters are trained.
    is_lora: bool
    #: The LoRA rank, or None.
    lora_rank: int | None
    #: ``"policy"`` or ``"critic"``.
    role: str
    #: The engine's registry name.
    engine: str
    #: Parameters of the whole model.
    num_parameters: int
    #: Parameters that receive gradients.
    num_trainable_parameters: int
    #: Whether datums that start alike (an RL group's prompt) are computed with their common
    #: head once: "on: ..." or "off: <why>" (engine_config ``prefix_sharing``).
    prefix_sharing: str = "off"
    #: The sampler's registry name: what serves ``sample`` (``"transformers"``, ``"vllm"``, ...).
    sampler: str = "transformers"
