"""The decode-speed benchmark: AR GR2 against block-diffusion re-rankers, in one run, on the same prompts.

Speed is only ever reported as a ratio against the best AR decoder for the same
weights measured in the same run (the faster of our KV-cache loop `ar_generate`
and Hugging Face `generate`), at each batch size, so machine load and hardware
cancel out as far as they can. Every decoder decodes the same re-ranking
examples greedily, at the model's real reasoning length, and its answers go
through the shared parser, so each speed row also carries the accuracy and
validity it was bought at.

Rows (one per decoder, model, threshold, sub-block size and batch size):
    decoder: "ar" (our loop), "hf" (HF generate) or "diffusion"
    model: the model's name (e.g. "gr2", "dgr2-cft")
    tau: the commit threshold (None for AR)
    sub_block_size: the diffusion decoder's sub-block size (None: whole
        blocks, and for AR); rows with one come only when asked for
    sub_block_cache: True on the rows decoded with the approximate sub-block
        cache (`diffusion_generate`'s sub_block_cache; only when asked for),
        False on the other diffusion rows, None for AR and speculative rows
    explanation_tau, explanation_sub_block_size: the threshold and sub-block
        size after the answer (None: tau, sub_block_size), rows with them
        only when asked for (constrained decoding)
    grammar: whether the row decoded under the answer grammar (True only on
        diffusion rows of a constrained bench; a served model decodes without)
    batch_size, n (examples)
    repeats: timed passes of the row (after an untimed warm-up over every row),
        interleaved: at batch size 1 example by example (every row decodes example
        i `repeats` times before any decodes i + 1), at larger batch sizes pass by
        pass (pass r of every row before pass r + 1)
    seconds: the decode time of all n examples (tokenisation excluded): at batch size
        1 the sum over examples of the median of the example's passes, else the
        median pass; seconds_min, seconds_max: the fastest and slowest pass's total
    seconds_per_example: seconds / n, the time to a full response
    tokens_per_s: generated tokens (eos included) per second of decoding (median pass)
    speedup: the best AR seconds_per_example at this batch size / the row's: how
        much sooner a response is complete. Time per example, not tokens/s, since
        each decoder writes its own explanation: a decoder that writes shorter (or
        looser) explanations must not be credited for the tokens it did not write
    tokens_per_s_speedup: tokens_per_s / that of the same AR reference row (the old ratio,
        kept as a column: it differs from speedup where response lengths differ)
    nfe_per_token: model forwards per generated token of one row, i.e.
        the sum over batches of nfe * rows / generated tokens (1.0 for AR at
        any batch size; a batch forward serves every row of the batch)
    tokens_per_forward: 1 / nfe_per_token
    forward_cost: seconds per batch forward over those of our AR loop ("ar") at
        this batch size: what one step of this decoder costs in one-token
        forwards (1.0 for "ar").
    projected_speedup: tokens_per_forward over that of "ar" at this batch
        size: the speed-up if a forward cost the same whatever the number of
        positions it decodes, the assumption for a GPU at small batch, where a
        forward of a small model is bound by reading the weights, not by the
        positions (an assumption, not a measurement).
    response_tokens: mean generated tokens per example
    recall@1, ndcg@3, valid_format_rate, valid_permutation_rate
    grammar_changed_rate: under constrained decoding, the share of answers the
        grammar changed (None when unconstrained)
    explanation_nll_gr2: with a scorer, GR2's mean NLL per explanation token
        (`rerank_eval.explanation_nll`; None without one)
    draft_len, draft_steps, draft_mode, mean_accepted_length, ar_forwards_per_token,
    draft_forwards_per_token, equal_to_gr2: speculative rows only (None
        elsewhere), see below

Speculative rows (decoder "spec", model: the drafter's name, tau None): GR2
verifies what the diffusion model drafts (`gr2model.decoding.speculative`, greedy), so
the answers are GR2's own and only the speed differs. draft_len tokens drafted
per round in draft_steps denoising forwards, on the drafter's blocks or in a
window after the accepted tokens (draft_mode "block" or "window",
`gr2model.decoding.speculative.diffusion_drafter`); mean_accepted_length: draft tokens
accepted per row verification; ar_forwards_per_token and
draft_forwards_per_token: each model's forwards per generated token of one row
(as nfe_per_token, which is their sum); equal_to_gr2: the share of examples
whose tokens equal those of our AR loop ("ar") at the same batch size in the
same run (1.0 unless a floating-point near-tie broke apart).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gr2model.decoding.ar_decode import ar_generate, hf_generate
from gr2model.models.block_diffusion import block_diffusion_settings
from gr2model.decoding.diffusion_decode import diffusion_generate
from gr2model.eval.rerank_eval import LMRerankResult, lm_rerank, mean_explanation_nll, speculative_kwargs
from gr2model.task.rerank_format import FormatConfig, ItemText, rerank_metrics
from gr2model.decoding.speculative import SpeculativeDecodeOutput

log = logging.getLogger(__name__)

SPEED_FIELDS = (
    "decoder", "model", "tau", "sub_block_size", "sub_block_cache", "explanation_tau", "explanation_sub_block_size", "grammar", "batch_size", "n",
    "repeats", "seconds", "seconds_min", "seconds_max", "seconds_per_example", "tokens_per_s", "speedup", "tokens_per_s_speedup", "nfe_per_token",
    "tokens_per_forward", "forward_cost", "projected_speedup", "response_tokens", "recall@1", "ndcg@3", "valid_format_rate", "valid_permutation_rate",
    "grammar_changed_rate", "explanation_nll_gr2", "draft_len", "draft_steps", "draft_mode", "mean_accepted_length", "ar_forwards_per_token", "draft_forwards_per_token",
    "equal_to_gr2",
)  # fmt: skip
# The fields only speculative rows fill (None on the others).
SPEC_FIELDS = SPEED_FIELDS[SPEED_FIELDS.index("draft_len") :]


def equal_share(sequences: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """The share of rows whose token ids equal the reference row's (same order, same length)."""
    if len(sequences) != len(reference):
        raise ValueError(f"{len(sequences)} sequences vs {len(reference)} reference rows")
    return sum(list(a) == list(b) for a, b in zip(sequences, reference)) / max(len(sequences), 1)


def row_forwards(out: LMRerankResult, attr: str = "nfe", batch_size: int = 1) -> int:
    """Forwards as one row sees them: each batch's forwards (`attr` of its output) times its rows, summed.

    A batch forward serves every row of the batch, so this over the generated
    tokens is forwards per token of one row. Without per-batch outputs:
    out.nfe * batch_size (every batch full).
    """
    if not out.outputs:
        return getattr(out, attr) * batch_size
    return sum(getattr(o, attr) * len(o.sequences) for o in out.outputs)


def speculative_stats(out: LMRerankResult) -> dict[str, float]:
    """The counts of a speculative `lm_rerank` (every batch a `SpeculativeDecodeOutput`), over all its batches.

    mean_accepted_length: accepted draft tokens per row verification;
    ar_forwards_per_token, draft_forwards_per_token: forwards of each model
    per generated token of one row, as the rows' nfe_per_token (their sum).
    """
    spec = [o for o in out.outputs if isinstance(o, SpeculativeDecodeOutput)]
    if not spec or len(spec) != len(out.outputs):
        raise ValueError("speculative_stats needs the outputs of a speculative decode")
    tokens = max(out.generated_tokens, 1)
    verifications = sum(o.row_verifications for o in spec)
    return {
        "mean_accepted_length": sum(o.accepted_tokens for o in spec) / verifications if verifications else 0.0,
        "ar_forwards_per_token": row_forwards(out, "ar_nfe") / tokens,
        "draft_forwards_per_token": row_forwards(out, "draft_nfe") / tokens,
    }


@dataclass
class _Job:
    """One row of the benchmark before it is timed: what it decodes with and how to decode it."""

    meta: dict[str, Any]  # the row's setting fields (decoder, model, tau, ..., grammar, batch_size)
    decode: Callable[..., LMRerankResult]  # (table, quiet=False) -> its decode
    spec: tuple[int, int, str] | None = None  # (draft_len, draft_steps, draft_mode) of a speculative row


def _timed_passes(jobs: Sequence[_Job], lists: pl.DataFrame, repeats: int) -> tuple[list[LMRerankResult], list[list[float]], list[float]]:
    """Time every job `repeats` times over `lists`, interleaved; returns, per job, its first
    pass's result, each pass's total seconds and its time (the sum over slices of the median
    over the passes of the slice's time).

    Jobs of batch size 1 go one example at a time: every job decodes example i, `repeats`
    times, before any decodes example i + 1, so a burst of other load or a drift of the
    machine's speed lands on every decoder within seconds of each other, and the median
    per example drops a pass that a burst hit. Larger batch sizes decode the whole table per
    pass (slicing would change their batches), pass r of every job before pass r + 1.
    """
    n = lists.height
    parts: list[list[LMRerankResult]] = [[] for _ in jobs]  # each job's first-pass result of every slice, in order
    totals: list[list[float]] = [[0.0] * repeats for _ in jobs]
    medians = [0.0] * len(jobs)
    for bs in dict.fromkeys(int(job.meta["batch_size"]) for job in jobs):
        idx = [i for i, job in enumerate(jobs) if int(job.meta["batch_size"]) == bs]
        slices = [lists.slice(e, 1) for e in range(n)] if bs == 1 else [lists]
        for piece in tqdm(slices, desc=f"bench b{bs}: {len(idx)} rows x {repeats} passes", leave=False, disable=len(slices) == 1):
            times: dict[int, list[float]] = {i: [] for i in idx}
            for r in range(repeats):
                for i in idx:
                    out = jobs[i].decode(piece, quiet=len(slices) > 1)
                    times[i].append(out.seconds)
                    totals[i][r] += out.seconds
                    if r == 0:
                        parts[i].append(out)
            for i in idx:
                medians[i] += float(statistics.median(times[i]))
    outs = [p[0] if len(p) == 1 else LMRerankResult.concat(p) for p in parts]
    return outs, totals, medians


def _row(job: _Job, out: LMRerankResult, seconds: Sequence[float], targets: Sequence[int], median: float) -> dict[str, Any]:
    """A row from the job's decode (tokens, answers), its timed passes (`seconds`, one total per
    pass) and its time (`median`, `_timed_passes`)."""
    m = rerank_metrics(out.parsed, targets)
    bs = int(job.meta["batch_size"])
    tokens = max(out.generated_tokens, 1)
    n = len(out.parsed)
    return {
        **dict.fromkeys(SPEED_FIELDS),
        **job.meta,
        "n": n,
        "repeats": len(seconds),
        "seconds": median,
        "seconds_min": float(min(seconds)),
        "seconds_max": float(max(seconds)),
        "seconds_per_example": median / max(n, 1),
        "tokens_per_s": out.generated_tokens / max(median, 1e-9),
        "speedup": float("nan"),  # filled once the best AR decoder of this batch size is known
        "tokens_per_s_speedup": float("nan"),
        "forward_cost": float("nan"),  # filled against our AR loop's row (`relative_speeds`)
        "projected_speedup": float("nan"),
        "nfe_per_token": row_forwards(out, batch_size=bs) / tokens,
        "tokens_per_forward": tokens / max(row_forwards(out, batch_size=bs), 1),
        "response_tokens": out.generated_tokens / max(n, 1),
        "recall@1": m["recall@1"],
        "ndcg@3": m["ndcg@3"],
        "valid_format_rate": m["valid_format_rate"],
        "valid_permutation_rate": m["valid_permutation_rate"],
        "grammar_changed_rate": out.grammar_changed_rate,
        "_nfe": out.nfe,  # batch forwards, for forward_cost; dropped once it is computed
    }


def relative_speeds(rows: Sequence[dict[str, Any]]) -> None:
    """Fill every row's speedup, tokens_per_s_speedup, forward_cost and projected_speedup (module docstring), in place.

    At each batch size: the reference is the AR row ("ar" or "hf") with the least
    seconds_per_example; forward_cost and projected_speedup are against our AR loop ("ar").
    A batch size without AR rows leaves its rows' NaNs.
    """
    for bs in sorted({r["batch_size"] for r in rows}):
        at = [r for r in rows if r["batch_size"] == bs]
        ar_rows = [r for r in at if r["decoder"] in ("ar", "hf")]
        if not ar_rows:
            continue
        best = min(ar_rows, key=lambda r: r["seconds_per_example"])
        ours = next((r for r in ar_rows if r["decoder"] == "ar"), best)
        ar_step = ours["seconds"] / max(ours.get("_nfe") or 1, 1)
        for r in at:
            # Time to the full response: a decoder that writes a shorter explanation is not credited for it.
            r["speedup"] = best["seconds_per_example"] / max(r["seconds_per_example"], 1e-12)
            r["tokens_per_s_speedup"] = r["tokens_per_s"] / max(best["tokens_per_s"], 1e-12)
            step = r["seconds"] / max(r.get("_nfe") or 1, 1)
            r["forward_cost"] = step / ar_step if ar_step > 0 else float("nan")
            r["projected_speedup"] = r["tokens_per_forward"] / ours["tokens_per_forward"]


def decode_benchmark(
    ar_model: PreTrainedModel,
    diffusion_models: Mapping[str, PreTrainedModel],
    tok: PreTrainedTokenizerBase,
    lists: pl.DataFrame,
    items: ItemText,
    fmt: FormatConfig,
    *,
    taus: Sequence[float],
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    ar_name: str = "gr2",
    on_row: Callable[[dict[str, Any]], None] | None = None,
    sub_block_sizes: Sequence[int] = (),
    sub_block_cache_sizes: Sequence[int] = (),
    drafters: Mapping[str, PreTrainedModel] | None = None,
    draft_len: int = 8,
    draft_steps: int = 2,
    draft_mode: str = "block",
    constrained: bool = False,
    plain_settings: Sequence[tuple[float, int | None, bool]] = (),
    explanation_taus: Sequence[float] = (),
    explanation_sub_block_size: int | None = None,
    scorer: PreTrainedModel | None = None,
    repeats: int = 3,
    warmup: bool = True,
) -> list[dict[str, Any]]:
    """Decode `lists` with every decoder, threshold and batch size; one row each (module docstring).

    Timing: first a warm-up, every row decoding its first batch once, untimed (the first
    call of each decoder path pays for allocations and lazy set-up); then `repeats` timed
    passes over every row, interleaved (`_timed_passes`: example by example at batch size
    1, pass by pass above), so drift of the machine's speed during the run hits every
    decoder alike. `seconds_min` and `seconds_max` are the spread of the passes. Greedy
    decoding gives the same tokens on every pass; the answers are the first pass's.

    Args:
        ar_model: the AR re-ranker (eval mode).
        diffusion_models: name -> converted model (block size and mask id read
            from its config), all sharing `tok`.
        lists: re-ranking examples (history, candidates, target), the same for
            every decoder.
        taus: commit thresholds of the diffusion decoder.
        batch_sizes: batch sizes to measure (AR and diffusion alike).
        on_row: called with each row once every row is measured (progress).
        sub_block_sizes: besides the whole-block rows, one more row per
            diffusion model, threshold and S here, decoded with
            sub_block_size=S; a model whose block size S does not divide is
            skipped for that S (logged). Empty (default): no such rows.
        sub_block_cache_sizes: besides each of those rows whose S is here (and
            smaller than the block), one more decoded with the approximate
            sub-block cache (`sub_block_cache`: True). Empty: no such rows.
        drafters: name -> block-diffusion model: one speculative row each
            ("spec", module docstring), GR2 verifying its drafts of
            `draft_len` tokens made in `draft_steps` forwards, on its blocks or in a
            window (`draft_mode`, `gr2model.decoding.speculative.diffusion_drafter`). None: no such rows.
        constrained: decode the diffusion rows under the answer grammar
            (`gr2model.decoding.constrained`; their grammar_changed_rate says how many
            answers it changed; `grammar` True). The AR rows stay unconstrained: the faster AR
            decoder is the reference, and GR2's answers are valid anyway.
        plain_settings: with `constrained`, the (tau, sub_block_size, sub_block_cache)
            settings also decoded without the grammar (`grammar` False), e.g. the
            setting a model is served with, whose speed must be its own.
        explanation_taus: with `constrained`, besides each diffusion row, one
            more per threshold e here below its tau, decoding the explanation
            at e (`explanation_threshold`) and the answer at tau, with
            `explanation_sub_block_size` past the answer when given (a
            divisor of the block; the model is skipped for it otherwise).
            e equal to tau gives a row where that changes the decode: the
            row has sub-blocks and `explanation_sub_block_size` is another
            size (the explanation at the answer's threshold, in its own
            sub-blocks: the answer's tokens are the plain row's).
        scorer: an AR model (GR2) that scores every row's explanations
            (`explanation_nll_gr2`, `rerank_eval.explanation_nll`): what the
            faster settings cost the explanation. None: not scored.
        repeats: timed passes per row (at least 1; the median is reported).
        warmup: run the untimed warm-up pass first.
    Returns:
        The rows, AR first within each batch size, then diffusion, then
        speculative; `speedup` is the time per example of the faster of "ar" and "hf"
        at the same batch size over the row's.
    """
    if any(s < 1 for s in sub_block_sizes):
        raise ValueError(f"sub_block_sizes must be >= 1, got {list(sub_block_sizes)}")
    if not set(sub_block_cache_sizes) <= set(sub_block_sizes):
        raise ValueError(f"sub_block_cache_sizes {list(sub_block_cache_sizes)} must be among sub_block_sizes {list(sub_block_sizes)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    drafters = drafters or {}
    if drafters and (draft_len < 1 or draft_steps < 1):
        raise ValueError(f"draft_len and draft_steps must be >= 1, got {draft_len}, {draft_steps}")
    targets = lists["target"].to_list()
    plain = {(float(t), s, bool(c)) for t, s, c in plain_settings} if constrained else set()
    jobs: list[_Job] = []

    def call(model: PreTrainedModel, desc: str, bs: int, **kwargs: Any) -> Callable[..., LMRerankResult]:
        return lambda df, quiet=False: lm_rerank(
            model, tok, df, items, fmt, desc=desc, batch_size=bs, max_new_tokens=max_new_tokens, quiet=quiet, **kwargs
        )

    for bs in batch_sizes:
        for decoder_name, decoder in (("ar", ar_generate), ("hf", hf_generate)):
            meta = {"decoder": decoder_name, "model": ar_name, "tau": None, "batch_size": bs, "grammar": False}
            jobs.append(_Job(meta, call(ar_model, f"bench {decoder_name} b{bs}", bs, decoder=decoder)))
        for name, model in diffusion_models.items():
            block_size, mask_id = block_diffusion_settings(model)
            subs: list[int | None] = [None]
            for sub in sub_block_sizes:
                if block_size % sub == 0:
                    subs.append(sub)
                else:
                    log.warning("bench %s: sub-block size %d does not divide block size %d, skipped", name, sub, block_size)
            for tau in taus:
                for sub in subs:
                    # e == tau changes only the explanation's sub-blocks: a row only where they differ.
                    equal_ok = sub is not None and explanation_sub_block_size not in (None, sub)
                    variants: list[tuple[float | None, bool, bool]] = [
                        (e, False, constrained)
                        for e in [None, *(e for e in explanation_taus if constrained and (e < tau or (e == tau and equal_ok)))]
                    ]
                    if sub in sub_block_cache_sizes and sub < block_size:
                        variants.append((None, True, constrained))
                    for cached in (False, True):
                        if (float(tau), sub, cached) in plain and (None, cached, True) in variants:
                            variants.append((None, cached, False))
                    for expl, cached, grammar in variants:
                        tag = ("" if sub is None else f" s{sub}") + ("" if expl is None else f" e{expl}") + (" cache" if cached else "")
                        tag += " grammar" if grammar else ""
                        extra: dict[str, Any] = {"sub_block_cache": True} if cached else {}
                        if expl is not None:
                            extra["explanation_threshold"] = expl
                            if explanation_sub_block_size is not None and block_size % explanation_sub_block_size == 0:
                                extra["explanation_sub_block_size"] = explanation_sub_block_size
                        meta = {
                            "decoder": "diffusion", "model": name, "tau": tau, "sub_block_size": sub, "sub_block_cache": cached,
                            "explanation_tau": expl, "explanation_sub_block_size": extra.get("explanation_sub_block_size"),
                            "batch_size": bs, "grammar": grammar,
                        }  # fmt: skip
                        jobs.append(_Job(meta, call(
                            model, f"bench {name} tau {tau}{tag} b{bs}", bs, decoder=diffusion_generate, mask_id=mask_id,
                            block_size=block_size, threshold=tau, sub_block_size=sub, constrained=grammar, **extra,
                        )))  # fmt: skip
        for name, drafter_model in drafters.items():
            meta = {"decoder": "spec", "model": name, "tau": None, "batch_size": bs, "grammar": False}
            # A fresh drafter state per decode: the drafter's cache is per call (`speculative_kwargs`).
            jobs.append(_Job(meta, lambda df, quiet=False, m=drafter_model, b=bs, n=name: lm_rerank(
                ar_model, tok, df, items, fmt, desc=f"bench spec {n} k{draft_len} b{b}", batch_size=b, max_new_tokens=max_new_tokens,
                quiet=quiet, **speculative_kwargs(m, draft_steps, draft_len, draft_mode),
            ), spec=(draft_len, draft_steps, draft_mode)))  # fmt: skip

    if warmup:
        for job in jobs:
            job.decode(lists.head(int(job.meta["batch_size"])))
    outs, seconds, medians = _timed_passes(jobs, lists, repeats)
    rows = [_row(job, out, s, targets, m) for job, out, s, m in zip(jobs, outs, seconds, medians, strict=True)]
    relative_speeds(rows)
    ar_sequences = {
        row["batch_size"]: out.sequences for row, out in zip(rows, outs, strict=True) if row["decoder"] == "ar"
    }  # our AR loop's tokens at each batch size: what the speculative rows must reproduce
    for job, row, out in zip(jobs, rows, outs, strict=True):
        del row["_nfe"]
        if job.spec is not None:
            row.update(
                draft_len=job.spec[0], draft_steps=job.spec[1], draft_mode=job.spec[2],
                equal_to_gr2=equal_share(out.sequences, ar_sequences[row["batch_size"]]), **speculative_stats(out),
            )  # fmt: skip
        elif scorer is not None:
            row["explanation_nll_gr2"] = mean_explanation_nll(scorer, tok, lists, items, fmt, out.sequences)
        if on_row:
            on_row(row)
    return rows


def speed_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a markdown table (the benchmark's printed and reported form).

    Speed as time per example (`speedup`, with the passes' spread) beside tokens/s.
    A sub_block_size column only when some row has one (sub_block_cache when
    some row takes the cache, grammar when some row decodes under it), and the speculative
    columns only when some row is speculative (the default table is unchanged).
    """
    cols: tuple[str, ...] = (
        "decoder", "model", "tau", "batch_size", "repeats", "seconds_per_example", "seconds_min", "seconds_max", "speedup", "tokens_per_s",
        "tokens_per_s_speedup", "nfe_per_token", "forward_cost", "projected_speedup", "response_tokens", "recall@1", "valid_format_rate",
    )  # fmt: skip
    if any(r.get("grammar") for r in rows):
        cols = cols[:3] + ("grammar",) + cols[3:]
    if any(r.get("explanation_sub_block_size") is not None for r in rows):
        cols = cols[:3] + ("explanation_sub_block_size",) + cols[3:]
    if any(r.get("explanation_tau") is not None for r in rows):
        cols = cols[:3] + ("explanation_tau",) + cols[3:]
    if any(r.get("sub_block_cache") for r in rows):
        cols = cols[:3] + ("sub_block_cache",) + cols[3:]
    if any(r.get("sub_block_size") is not None for r in rows):
        cols = cols[:3] + ("sub_block_size",) + cols[3:]
    if any(r.get("grammar_changed_rate") is not None for r in rows):
        cols += ("grammar_changed_rate",)
    if any(r.get("explanation_nll_gr2") is not None for r in rows):
        cols += ("explanation_nll_gr2",)
    if any(r.get("decoder") == "spec" for r in rows):
        cols += SPEC_FIELDS
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            if v is None:
                cells.append("-")
            elif isinstance(v, float) and c == "tokens_per_s":
                cells.append(f"{v:.0f}")
            elif isinstance(v, float) and c.startswith("seconds"):
                cells.append(f"{v:.4f}")  # a tiny model's example takes milliseconds
            else:
                cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
