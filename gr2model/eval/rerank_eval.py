"""Re-rank candidate lists with a language model or a fixed rule, judged by the one shared parser.

Every re-ranker, learned or baseline, ends as a list of ParsedResponse so that
`rerank_format.rerank_metrics` computes every table with the same code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from gr2model.decoding.ar_decode import DecodeOutput, ar_generate
from gr2model.models.block_diffusion import block_diffusion_settings
from gr2model.decoding.constrained import ResponseGrammar, answer_template, check_covered, covers
from gr2model.training.dapo import sequence_logprobs
from gr2model.decoding.diffusion_decode import check_sub_block_size, diffusion_generate
from gr2model.decoding.speculative import Drafter, SpeculativeDecodeOutput, diffusion_drafter, speculative_generate
from gr2model.task.rerank_format import REASONING_FIRST_OPENING, FormatConfig, ItemText, ParsedResponse, build_prompt, evidence_of, parse_response
from gr2model.task.tokenizer import single_token_id, special_ids

log = logging.getLogger(__name__)

Decoder = Callable[..., DecodeOutput]


def rerank_examples(lists: pl.DataFrame) -> pl.DataFrame:
    """The re-ranking examples of a candidate-list table: the target is among the K candidates."""
    return lists.filter(pl.col("target_rank") >= 0)


def prompts_of(lists: pl.DataFrame, items: ItemText, fmt: FormatConfig) -> list[str]:
    """The prompt text of every row (history and candidates in the incoming order, and
    the candidates' evidence levels when the format writes them)."""
    rows = zip(lists["history"].to_list(), lists["candidates"].to_list(), evidence_of(lists, fmt), strict=True)
    return [build_prompt(h, c, items, fmt, e) for h, c, e in rows]


def fixed_rankings(rankings: Sequence[Sequence[int]], incoming: Sequence[Sequence[int]]) -> list[ParsedResponse]:
    """ParsedResponse for rule-based re-rankers (pre-rank order, teacher, random): always valid."""
    return [
        ParsedResponse(
            valid_format=True,
            valid_permutation=True,
            ranking=list(r),
            explanation="",
            error="",
            copies_incoming=list(r) == list(inc),
        )
        for r, inc in zip(rankings, incoming, strict=True)
    ]


def random_rankings(incoming: Sequence[Sequence[int]], seed: int) -> list[list[int]]:
    """A seeded random permutation of each candidate list (the chance baseline)."""
    rng = np.random.default_rng(seed)
    return [list(np.asarray(c)[rng.permutation(len(c))]) for c in incoming]


def decoder_kwargs(
    model, threshold: float, sub_block_size: int | None = None, explanation_threshold: float | None = None,
    explanation_sub_block_size: int | None = None, sub_block_cache: bool = False,
) -> dict:
    """The `lm_rerank` keyword arguments that decode with the model's own decoder.

    An AR model: {} (our KV-cache AR loop; `sub_block_size` does not apply). A
    block-diffusion model (its config has block_size and mask_token_id): the
    threshold decoder with its block size, mask id and commit threshold
    `threshold`, plus `sub_block_size` when not None (sub-block decoding,
    `gr2model.decoding.diffusion_decode`; ValueError here if it does not divide the
    model's block size, before anything is decoded), and `explanation_threshold`
    when not None (the threshold after the answer; it needs `lm_rerank`'s
    `constrained`), and `explanation_sub_block_size` likewise (the sub-block
    size of the blocks past the answer), and `sub_block_cache` when True
    (Fast-dLLM v2's approximate sub-block cache; it changes the tokens).
    """
    if getattr(model.config, "block_size", None) is None:
        return {}
    block_size, mask_id = block_diffusion_settings(model)
    kwargs = {"decoder": diffusion_generate, "block_size": block_size, "mask_id": mask_id, "threshold": threshold}
    if sub_block_size is not None:
        check_sub_block_size(block_size, sub_block_size)
        kwargs["sub_block_size"] = sub_block_size
    if explanation_threshold is not None:
        kwargs["explanation_threshold"] = explanation_threshold
    if explanation_sub_block_size is not None:
        check_sub_block_size(block_size, explanation_sub_block_size)
        kwargs["explanation_sub_block_size"] = explanation_sub_block_size
    if sub_block_cache:
        kwargs["sub_block_cache"] = True
    return kwargs


def _speculative_decode(model, prompts, *, drafter: Drafter, **kwargs) -> SpeculativeDecodeOutput:
    """`speculative_generate` with the `Decoder` call shape (model, prompts, **kwargs) that `lm_rerank` uses."""
    return speculative_generate(model, drafter, prompts, **kwargs)


def speculative_kwargs(drafter_model, steps: int, draft_len: int, mode: str = "block") -> dict:
    """The `lm_rerank` keyword arguments that decode speculatively: the AR model passed to
    `lm_rerank` verifies, `drafter_model` (a block-diffusion model, block size and mask id
    from its config) drafts `draft_len` tokens per round in `steps` denoising forwards, on its
    blocks or in a window (`mode`, `gr2model.decoding.speculative.diffusion_drafter`).
    Greedy: the answers are the AR model's own (`gr2model.decoding.speculative`)."""
    return {"decoder": _speculative_decode, "drafter": diffusion_drafter(drafter_model, steps, mode), "draft_len": draft_len}


@dataclass
class LMRerankResult:
    """What `lm_rerank` decoded, in the input order (`outputs` in decoding order).

    sequences: each row's generated token ids (eos included), for token-level comparisons.
    outputs: the decoder's output of each batch (decoder-specific counts, e.g.
        `SpeculativeDecodeOutput.accepted_lengths`).
    """

    parsed: list[ParsedResponse]
    texts: list[str]
    generated_tokens: int
    nfe: int
    seconds: float
    sequences: list[list[int]] = field(default_factory=list)
    outputs: list[DecodeOutput] = field(default_factory=list)

    @property
    def grammar_changed_rate(self) -> float | None:
        """The share of the answers the grammar changed (`DecodeOutput.constrained`); None unconstrained."""
        changed = [c for o in self.outputs for c in (o.constrained or [])]
        return sum(changed) / len(changed) if changed else None

    @classmethod
    def concat(cls, parts: Sequence[LMRerankResult]) -> LMRerankResult:
        """One result for consecutive slices of a table decoded one after another (rows in slice order)."""
        return cls(
            parsed=[p for r in parts for p in r.parsed], texts=[t for r in parts for t in r.texts],
            generated_tokens=sum(r.generated_tokens for r in parts), nfe=sum(r.nfe for r in parts),
            seconds=sum(r.seconds for r in parts), sequences=[s for r in parts for s in r.sequences],
            outputs=[o for r in parts for o in r.outputs],
        )  # fmt: skip


def lm_rerank(
    model,
    tok,
    lists: pl.DataFrame,
    items: ItemText,
    fmt: FormatConfig,
    *,
    batch_size: int = 32,
    max_new_tokens: int = 320,
    decoder: Decoder = ar_generate,
    desc: str = "re-rank",
    state: PartialState | None = None,
    constrained: bool = False,
    response_prefix: str = "",
    quiet: bool = False,
    **decode_kwargs,
) -> LMRerankResult:
    """Decode a response for every row (greedy unless decode_kwargs say otherwise) and parse it.

    Rows are decoded in batches sorted by prompt length (less padding); results
    come back in the input order. An invalid answer falls back to the incoming
    order inside `parse_response` and is counted by the metrics.

    state: with several processes (accelerate's PartialState of a launched run), the
        batches are dealt round-robin to the processes (process r decodes batches r,
        r + N, ...; the model must already be on `state.device`) and gathered back,
        so every process returns the full result, `outputs` in batch order as on one
        process, and every batch holds the same rows with the same padding as on one
        process: the outputs do not depend on N. `seconds` then sums the decoding
        time of all processes.
    constrained: decode every answer under the format's grammar (greedy
        `ar_generate` or `diffusion_generate` only; `gr2model.decoding.constrained`), so
        every answer is a valid permutation; each output's `constrained` says
        which answers the grammar changed. ValueError for a format the grammar
        does not cover (it needs answer "index" written first).
    response_prefix: text forced at the start of every response (e.g.
        `rerank_format.no_reasoning_prefix`): appended to each prompt, and put
        before each decoded text for the parser; `sequences` hold the decoded
        tokens after it.
    quiet: no progress bar and no summary line (a caller that decodes many small
        slices shows its own progress).
    """
    ids = special_ids(tok)
    if constrained:
        check_covered(fmt, "constrained decoding")
        ks = [len(c) for c in lists["candidates"].to_list()]  # each row's grammar has its K slots
    forced = f" {response_prefix}" if response_prefix else ""
    prompts = [tok(p + forced, add_special_tokens=False)["input_ids"] for p in prompts_of(lists, items, fmt)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    world, rank = (state.num_processes, state.process_index) if state is not None else (1, 0)
    mine: list[tuple[int, DecodeOutput]] = []
    for b in tqdm(range(rank, len(batches), world), desc=desc, leave=False, disable=rank != 0 or quiet):
        prompts_b = [prompts[i] for i in batches[b]]
        if constrained:
            decode_kwargs["grammar"] = ResponseGrammar(
                tok, [ks[i] for i in batches[b]], max_new_tokens, vocab_size=model.config.vocab_size,
                device=next(model.parameters()).device,
            )
        mine.append((b, decoder(model, prompts_b, pad_id=ids["pad"], eos_id=ids["eos"], max_new_tokens=max_new_tokens, **decode_kwargs)))
    # gather_object concatenates the processes' lists (process 0's first): sort back into batch order.
    decoded = sorted(gather_object(mine), key=lambda t: t[0]) if world > 1 else mine
    texts: list[str] = [""] * len(prompts)
    sequences: list[list[int]] = [[] for _ in prompts]
    outputs: list[DecodeOutput] = []
    gen = nfe = 0
    seconds = 0.0
    for b, out in decoded:
        idx = batches[b]
        for i, seq in zip(idx, out.sequences, strict=True):
            texts[i] = f"{response_prefix} {tok.decode(seq, skip_special_tokens=False)}" if response_prefix else tok.decode(seq, skip_special_tokens=False)
            sequences[i] = list(seq)
        outputs.append(out)
        gen += out.generated_tokens
        nfe += out.nfe
        seconds += out.seconds
    candidates = lists["candidates"].to_list()
    parsed = [parse_response(t, c, items, fmt=fmt) for t, c in zip(texts, candidates, strict=True)]
    if not quiet:
        log.info("%s: %d rows, %d tokens in %.1f s (%.0f tok/s)", desc, len(parsed), gen, seconds, gen / max(seconds, 1e-9))
    return LMRerankResult(parsed, texts, gen, nfe, seconds, sequences, outputs)


@torch.inference_mode()
def explanation_nll(
    scorer, tok, lists: pl.DataFrame, items: ItemText, fmt: FormatConfig, sequences: Sequence[Sequence[int]], *,
    batch_size: int = 64,
) -> np.ndarray:
    """(n,) each answer's mean negative log-likelihood per token of its explanation under `scorer`.

    The explanation's tokens (`explanation_bounds`) are scored by an AR model
    (`scorer`, e.g. GR2) given the prompt and whatever the answer wrote before
    them, teacher-forced. It says how much an explanation reads like what the
    scorer would write: a parallel decoder that commits the explanation loosely
    writes repeats and fragments that GR2 finds unlikely. NaN where the answer has
    no explanation to score.
    """
    if len(sequences) != lists.height:
        raise ValueError(f"{len(sequences)} answers for {lists.height} lists")
    pad = special_ids(tok)["pad"]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts_of(lists, items, fmt)]
    opening = explanation_opening_ids(tok)
    quote = single_token_id(tok, '"')
    bounds = [explanation_bounds(seq, fmt, len(c), opening, quote) for seq, c in zip(sequences, lists["candidates"].to_list(), strict=True)]
    out = np.full(len(sequences), np.nan)
    for lo in range(0, len(sequences), batch_size):
        rows = [i for i in range(lo, min(lo + batch_size, len(sequences))) if bounds[i] is not None]
        if not rows:
            continue
        logp, mask = sequence_logprobs(scorer, [prompts[i] for i in rows], [list(sequences[i]) for i in rows], pad)
        cols = torch.arange(logp.shape[1], device=logp.device)
        for j, i in enumerate(rows):
            start, end = bounds[i]  # type: ignore[misc]
            keep = (cols >= start) & (cols < end) & (mask[j] > 0)
            out[i] = float(-logp[j][keep].mean())
    return out


def explanation_opening_ids(tok) -> list[int]:
    """The ids of `{ "explanation" : "`, the opening of a reasoning-first response."""
    return [single_token_id(tok, t) for t in REASONING_FIRST_OPENING]


def explanation_bounds(seq: Sequence[int], fmt: FormatConfig, k: int, opening: Sequence[int], quote: int) -> tuple[int, int] | None:
    """[start, end) of the explanation among a response's token ids, or None when there is none to score.

    Rank-first (the grammar's format): everything after the K-candidate answer
    template (its words and the closing `" } eos`). Reasoning first: the words
    between the opening `{ "explanation" : "` and the next `"` token (an answer
    that does not open so, or never closes its explanation, has none).
    """
    if covers(fmt):
        start = len(answer_template(k))
        return (start, len(seq)) if len(seq) > start else None
    n = len(opening)
    if list(seq[:n]) != list(opening):
        return None
    end = next((j for j in range(n, len(seq)) if seq[j] == quote), None)
    return (n, end) if end is not None and end > n else None


def mean_explanation_nll(
    scorer, tok, lists: pl.DataFrame, items: ItemText, fmt: FormatConfig, sequences: Sequence[Sequence[int]], *,
    batch_size: int = 64,
) -> float | None:
    """The mean of `explanation_nll` over the answers that have an explanation (None when none has)."""
    nll = explanation_nll(scorer, tok, lists, items, fmt, sequences, batch_size=batch_size)
    return float(np.nanmean(nll)) if np.isfinite(nll).any() else None
