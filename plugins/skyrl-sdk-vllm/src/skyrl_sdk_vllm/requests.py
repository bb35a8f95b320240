"""One ``SampleRequest`` as vLLM requests, and vLLM's outputs as ``SampleOutput``s.

The semantics are the built-in sampler's (docs/engines.md, Samplers):

- **stop rules** are ours, not the model's generation config: vLLM's own EOS handling is off
  (``ignore_eos``) and the stop token ids are given explicitly (the source's EOS for
  ``stop=None``, none for ``stop=[]``, exactly the listed ones otherwise); a stop string ends a
  sequence at the token that completes it, which is returned (vLLM keeps it in ``token_ids``);
- **logprobs** are the raw model's (``logprobs_mode="raw_logprobs"``): temperature 1, before
  top-k / top-p, what ``forward`` reports;
- **seeds** are vLLM's per-request generators (sample ``i`` of a seeded request draws with
  ``seed + i``): reproducible, but not the built-in sampler's draws;
- **prompt logprobs** come from one request per distinct prompt (vLLM computes them on
  the prompt's first request only).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from skyrl_sdk.sampling import SampleRequest
from skyrl_sdk.types import SampledSequence, SampleOutput

#: every option of a SampleRequest this sampler serves (``Sampler.refuse`` names any other)
SERVED = ("sampling_params.max_tokens", "sampling_params.temperature", "sampling_params.top_k",
          "sampling_params.top_p", "sampling_params.seed", "sampling_params.stop", "num_samples", "prompt_logprobs",
          "topk_prompt_logprobs")


def sampling_params(request: SampleRequest, eos_token_id: int | None, *, n: int, max_tokens: int | None = None,
                    prompt_logprobs: int | None = None) -> Any:
    """``vllm.SamplingParams`` for ``n`` samples of one prompt of ``request``."""
    from vllm import SamplingParams

    p = request.sampling_params
    if p.stop is None:
        stop_ids, strings = ([] if eos_token_id is None else [int(eos_token_id)]), []
    else:
        stop_ids = sorted({int(s) for s in p.stop if not isinstance(s, str)})
        strings = [s for s in p.stop if isinstance(s, str)]
    return SamplingParams(
        n=n, max_tokens=p.max_tokens if max_tokens is None else max_tokens, temperature=p.temperature,
        top_k=p.top_k if p.top_k > 0 else 0, top_p=p.top_p, seed=p.seed,
        ignore_eos=True, stop_token_ids=stop_ids, stop=strings or None, include_stop_str_in_output=True,
        skip_special_tokens=False, spaces_between_special_tokens=False, detokenize=bool(strings),
        logprobs=0, prompt_logprobs=prompt_logprobs,
    )


def prefill_params() -> Any:
    """One greedy token: a request that only puts its prompt in the prefix cache."""
    from vllm import SamplingParams

    return SamplingParams(n=1, max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)


def prompt_logprobs_of(request: SampleRequest) -> int | None:
    """vLLM's ``prompt_logprobs`` for ``request``: the top-k asked (0: only the prompt's own tokens)."""
    if request.topk_prompt_logprobs > 0:
        return request.topk_prompt_logprobs
    return 0 if request.prompt_logprobs else None


def sequences(output: Any) -> list[SampledSequence]:
    """The samples of one ``vllm.RequestOutput``, in order."""
    seqs = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        tokens = [int(t) for t in completion.token_ids]
        logprobs = [float(completion.logprobs[i][t].logprob) for i, t in enumerate(tokens)]
        seqs.append(SampledSequence(tokens=tokens, logprobs=logprobs,
                                    stop_reason="stop" if completion.finish_reason == "stop" else "length"))
    return seqs


def prompt_scores(
    output: Any, prompt: np.ndarray, request: SampleRequest,
) -> tuple[list[float | None] | None, list[list[tuple[int, float]] | None] | None]:
    """``(prompt_logprobs, topk_prompt_logprobs)`` of one prompt, as ``SampleOutput`` holds them."""
    table = output.prompt_logprobs
    if table is None:
        return None, None
    plps: list[float | None] | None = None
    topks: list[list[tuple[int, float]] | None] | None = None
    if request.prompt_logprobs:
        plps = [None] + [float(table[i][int(prompt[i])].logprob) for i in range(1, len(prompt))]
    if request.topk_prompt_logprobs > 0:
        k = request.topk_prompt_logprobs
        topks = [None] + [[(int(t), float(lp.logprob)) for t, lp in sorted(table[i].items(), key=lambda x: x[1].rank)
                           if lp.rank <= k][:k] for i in range(1, len(prompt))]
    return plps, topks


def sample_output(seqs: list[SampledSequence], scores: tuple) -> SampleOutput:
    return SampleOutput(sequences=seqs, prompt_logprobs=scores[0], topk_prompt_logprobs=scores[1])
