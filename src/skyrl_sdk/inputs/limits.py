"""Length limits in one wording, whoever applies them: a datum's tokens, or a prompt plus
``max_tokens``, against a model's positions (``Backend``) or a server's limit for the model
(``skyrl-sdk serve``, checked before anything is allocated)."""

from __future__ import annotations

#: what an in-process limit comes from
MODEL_POSITIONS = "max_position_embeddings"


def sequence_length_problem(length: int, limit: int | None, what: str = "model_input",
                            source: str = MODEL_POSITIONS) -> str | None:
    """Why a sequence of ``length`` tokens does not fit ``limit`` (which comes from ``source``), or None."""
    if limit is None or length <= limit:
        return None
    return f"{what} has {length} tokens; this model accepts at most {limit} ({source})"


def prompt_length_problem(prompt_tokens: int, max_tokens: int, limit: int | None,
                          source: str = MODEL_POSITIONS) -> str | None:
    """Why a prompt of ``prompt_tokens`` plus ``max_tokens`` generated ones does not fit, or None."""
    return sequence_length_problem(prompt_tokens + max_tokens, limit,
                                   f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens})", source)
