"""Our own decode loop over the KV cache: bounded memory, each prompt prefilled once.

- **Prefill** all distinct prompts in one left-padded batch (attention mask + position ids),
  once per prompt: the KV cache is then repeated ``num_samples`` times (rows of one prompt
  are adjacent), so samples share the prompt's compute. A prompt sent several times (the
  server merges a group's separate requests into one call) is prefilled once too.
- **Decode** one token per live row per step; only the (rows x steps) token ids and
  logprobs are kept, never a (rows x steps x vocab) tensor: the live (rows x vocab) logits
  of one step are the largest buffer.
- **bfloat16 weights**: the sampled sequences are scored once more the way ``forward``
  does (``rescore``, with ``forward``'s shared-prefix rows when ``prefix_min_tokens`` is
  given), so the returned logprobs equal ``forward``'s in every dtype.
- **Finished rows leave the batch**: once a quarter of the rows still in the batch have
  stopped, they are dropped from the cache (``batch_select_indices``), so stopped rows stop
  costing compute; until then they ride along and their draws are ignored.

The backbone and the output head are called directly (the head only on the positions that
need logits), with the head ``forward`` uses, so logprobs agree with ``forward``.

A vision-language model's prompts may hold images (``ModelInput``s with prepared image
chunks): the prefill reads their pixels and M-RoPE positions, and each row's generated
tokens continue from its largest position plus one, as the families' ``generate`` does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from ..models.loading import hf_model
from ..models.scoring import Head, backbone_of
from ..models.vlm import as_model_input, is_vision_language, padded_rows_inputs, text_config
from ..types import ModelInput, PromptAltTokens, SampledSequence, SampleOutput, SampleRequest, SamplingParams
from .draw import choose, request_generator
from .scores import needs_rescoring, prompt_alt_tokens, rescore
from .scores import prompt_logprobs as score_prompt
from .scores import target_prompt_logprobs as score_targets
from .scores import topk_prompt_logprobs as topk_prompt
from .stops import StopRules, StopStringWatcher

#: what the step loop returns per row: tokens, logprobs, length, stopped, and the top-k pairs (or None)
_Decoded = tuple[list[list[int]], list[list[float]], list[int], list[bool], list[list[list[tuple[int, float]]]] | None]


def _left_padded(prompts: Sequence[np.ndarray], pad_token_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.from_numpy(np.asarray(p, dtype=np.int64))
        mask[r, width - len(p):] = 1
    positions = (mask.cumsum(1) - 1).clamp_(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


@torch.no_grad()
def generate(
    module: torch.nn.Module,
    tokenizer: Any,
    request: SampleRequest,
    *,
    device: torch.device,
    eos_token_id: int | None,
    pad_token_id: int,
    prefix_min_tokens: int | None = None,
) -> list[SampleOutput]:
    """Serve ``request`` on ``module``: ``num_samples`` continuations of every prompt, one
    :class:`SampleOutput` per prompt, and every score it asks for from the same prefill and
    decode steps (Tinker's ``topk_sample_logprobs``, ``target_prompt_logprobs`` and
    ``prompt_alt_tokens_k`` included). ``prefix_min_tokens``: the engine's prefix sharing
    (None: off), for rescoring as ``forward``.
    """
    prompts, params, num_samples = request.prompts, request.sampling_params, request.num_samples
    hf = hf_model(module)
    backbone = backbone_of(module)
    head = Head(hf.get_output_embeddings(), hf.config)
    vocab = int(text_config(hf.config).vocab_size)
    vision_language = is_vision_language(hf.config)
    rules = StopRules.of(params, eos_token_id, tokenizer)
    generator = request_generator(params.seed, device)

    distinct, source = _distinct(prompts)
    token_rows = [p.to_numpy() if isinstance(p, ModelInput) else p for p in distinct]
    ids, mask, positions = _left_padded(token_rows, pad_token_id, device)
    vision = {}
    if vision_language:  # M-RoPE positions and the prompts' images
        vision = {k: v.to(device) for k, v in padded_rows_inputs([as_model_input(p) for p in distinct], ids.shape[1],
                                                                  left_padded=True).items()}
        positions = vision.pop("position_ids")
    cache = DynamicCache(config=hf.config)
    forward_step = _stepper(backbone, cache)
    out = forward_step(ids, mask, positions, **vision)
    hidden = out.last_hidden_state
    width = ids.shape[1]
    plps, topks = [], []
    for p, prompt in enumerate(token_rows):
        h = hidden[p, width - len(prompt):]
        plps.append(score_prompt(h, head, ids[p, width - len(prompt):], vocab) if request.prompt_logprobs else None)
        topks.append(topk_prompt(h, head, request.topk_prompt_logprobs, vocab)
                     if request.topk_prompt_logprobs > 0 else None)
    targets: list[np.ndarray | None] = [None] * len(prompts)
    alts: list[PromptAltTokens | None] = [None] * len(prompts)
    for p, d in enumerate(source.tolist()):  # per request prompt: alternatives are drawn for each
        h = hidden[d, width - len(token_rows[d]):]
        target_ids = None if request.target_prompt_logprobs is None else request.target_prompt_logprobs[p]
        if target_ids is not None:
            targets[p] = score_targets(h, head, target_ids, vocab)
        if request.prompt_alt_tokens_k > 0:
            alts[p] = PromptAltTokens(*prompt_alt_tokens(h, head, request.prompt_alt_tokens_k, params.temperature,
                                                         generator, vocab))
    logits = head(hidden[:, -1]).float()
    # each row's next position: its length, or (M-RoPE) its largest position plus one
    next_pos = (positions.amax(dim=(0, 2)) if positions.dim() == 3 else positions.amax(dim=1)) + 1
    del out, hidden
    rows = np.repeat(source, num_samples)  # each sample's row: its prompt's prefill
    if not np.array_equal(rows, np.arange(len(distinct))):
        index = torch.from_numpy(rows).to(device)
        cache.batch_select_indices(index)
        logits, mask, next_pos = logits.index_select(0, index), mask.index_select(0, index), next_pos[index]
    tokens, logprobs, lengths, stopped, topk_rows = _decode(forward_step, head, cache, logits, mask, next_pos, params,
                                                            rules, generator, tokenizer, pad_token_id,
                                                            request.topk_sample_logprobs)
    del cache
    if needs_rescoring(hf):
        logprobs = rescore(backbone, head, vocab, prompts, num_samples, tokens, lengths, pad_token_id, device,
                           prefix_min_tokens, vision_language=vision_language)
    results = []
    for p in range(len(prompts)):
        seqs = []
        for r in range(p * num_samples, (p + 1) * num_samples):
            n = lengths[r]
            seqs.append(SampledSequence(tokens=tokens[r][:n], logprobs=logprobs[r][:n],
                                        stop_reason="stop" if stopped[r] else "length",
                                        topk_logprobs=topk_rows[r][:n] if topk_rows is not None else None))
        results.append(SampleOutput(sequences=seqs, prompt_logprobs=plps[source[p]],
                                    topk_prompt_logprobs=topks[source[p]], target_prompt_logprobs=targets[p],
                                    prompt_alt_tokens=alts[p]))
    return results


def _distinct(prompts: Sequence[np.ndarray | ModelInput]) -> tuple[list[np.ndarray | ModelInput], np.ndarray]:
    """The distinct prompts (first-seen order), and for each prompt the index of its copy (a
    prompt with images is the same as another only when its images are the same too)."""
    seen: dict[bytes, int] = {}
    distinct: list[np.ndarray | ModelInput] = []
    source: list[int] = []
    for p in prompts:
        arr: np.ndarray | ModelInput
        if isinstance(p, ModelInput):
            arr = p
            key = p.to_numpy().tobytes() + "".join(getattr(c, "digest", "") for c in p.images).encode()
        else:
            tokens = np.asarray(p, dtype=np.int64)
            arr, key = tokens, tokens.tobytes()
        if key not in seen:
            seen[key] = len(distinct)
            distinct.append(arr)
        source.append(seen[key])
    return distinct, np.asarray(source, dtype=np.int64)


def _stepper(backbone: torch.nn.Module, cache: DynamicCache) -> Callable[..., Any]:
    """``step(ids, mask, positions)``: one backbone call that extends ``cache`` in place."""
    params = inspect.signature(backbone.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x: ``cache``

    def step(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, **vision: torch.Tensor) -> Any:
        return backbone(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{name: cache},
                        **vision)

    return step


def _decode(step_fn: Callable[..., Any], head: Head, cache: DynamicCache, logits: torch.Tensor, mask: torch.Tensor,
            next_pos: torch.Tensor, params: SamplingParams, rules: StopRules, generator: torch.Generator,
            tokenizer: Any, pad_token_id: int, topk: int = 0) -> _Decoded:
    """The step loop: returns per row (tokens, logprobs, length, stopped) as Python lists, and
    with ``topk`` per row and step the ``topk`` most likely (token, logprob) pairs (else None)."""
    rows, steps, device = logits.shape[0], params.max_tokens, logits.device
    out_tokens = torch.full((rows, steps), pad_token_id, dtype=torch.long, device=device)
    out_logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=device)
    k = min(topk, logits.shape[-1])
    top_ids = torch.zeros((rows, steps, k), dtype=torch.long, device=device) if k else None
    top_lps = torch.zeros((rows, steps, k), dtype=torch.float32, device=device) if k else None
    lengths = torch.full((rows,), steps, dtype=torch.long, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    live = torch.arange(rows, device=device)  # batch row -> original row
    done = torch.zeros(rows, dtype=torch.bool, device=device)  # stopped, still in the batch
    stop_ids = rules.token_tensor(device)
    watcher = StopStringWatcher(tokenizer, rules.strings) if rules.strings else None
    texts: list[list[int]] = [[] for _ in range(rows)] if watcher else []
    for step in range(steps):
        tok, lp = choose(logits, params, generator)
        out_tokens[live, step] = tok
        out_logprobs[live, step] = lp
        if top_ids is not None and top_lps is not None:  # k > 0
            values, indices = torch.topk(logits, k, dim=-1)
            top_ids[live, step] = indices
            top_lps[live, step] = values - torch.logsumexp(logits, dim=-1, keepdim=True)
        newly = torch.isin(tok, stop_ids) & ~done if stop_ids is not None else None
        if watcher is not None:
            hits = _string_hits(watcher, texts, live.tolist(), tok.tolist(), done.tolist())
            hits_t = torch.tensor(hits, dtype=torch.bool, device=device)
            newly = hits_t if newly is None else newly | hits_t
        if newly is not None and bool(newly.any()):
            lengths[live[newly]] = step + 1
            stopped[live[newly]] = True
            done |= newly
        if step == steps - 1 or bool(done.all()):
            break
        if 4 * int(done.sum()) >= done.shape[0] > 0 and bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            mask, next_pos, live, tok, done = mask[keep], next_pos[keep], live[keep], tok[keep], done[keep]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        hidden = step_fn(tok.unsqueeze(1), mask, next_pos.unsqueeze(1)).last_hidden_state
        next_pos = next_pos + 1
        logits = head(hidden[:, -1]).float()
    topk_rows = None
    if top_ids is not None and top_lps is not None:  # k > 0
        topk_rows = [[list(zip(i, v, strict=True)) for i, v in zip(ids_r, lps_r, strict=True)]
                     for ids_r, lps_r in zip(top_ids.cpu().tolist(), top_lps.cpu().tolist(), strict=True)]
    return (out_tokens.cpu().tolist(), out_logprobs.cpu().tolist(), lengths.cpu().tolist(), stopped.cpu().tolist(),
            topk_rows)


def _string_hits(watcher: StopStringWatcher, texts: list[list[int]], live: list[int], toks: list[int],
                 done: list[bool]) -> list[bool]:
    """Append this step's tokens to the live rows' texts and check them for stop strings."""
    running = [i for i, d in enumerate(done) if not d]
    for i in running:
        texts[live[i]].append(toks[i])
    found = watcher.hits([texts[live[i]] for i in running]) if running else []
    hits = [False] * len(done)
    for i, hit in zip(running, found, strict=True):
        hits[i] = hit
    return hits
