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
    batch_size, n (examples), seconds (decode time, tokenisation excluded)
    tokens_per_s: generated tokens (eos included) per second of decoding
    speedup: tokens_per_s / the best AR tokens_per_s at this batch size
    nfe_per_token: model forwards per generated token of one row, i.e.
        the sum over batches of nfe * rows / generated tokens (1.0 for AR at
        any batch size; a batch forward serves every row of the batch)
    tokens_per_forward: 1 / nfe_per_token
    forward_cost: seconds per batch forward over those of our AR loop ("ar") at
        this batch size: what one step of this decoder costs in one-token
        forwards (1.0 for "ar"). speedup = tokens_per_forward / forward_cost
        relative to "ar" (up to hf being the faster AR decoder).
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
verifies what the diffusion model drafts (`gr2model.speculative`, greedy), so
the answers are GR2's own and only the speed differs. draft_len tokens drafted
per round in draft_steps denoising forwards, on the drafter's blocks or in a
window after the accepted tokens (draft_mode "block" or "window",
`gr2model.speculative.diffusion_drafter`); mean_accepted_length: draft tokens
accepted per row verification; ar_forwards_per_token and
draft_forwards_per_token: each model's forwards per generated token of one row
(as nfe_per_token, which is their sum); equal_to_gr2: the share of examples
whose tokens equal those of our AR loop ("ar") at the same batch size in the
same run (1.0 unless a floating-point near-tie broke apart).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import polars as pl
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gr2model.ar_decode import ar_generate, hf_generate
from gr2model.block_diffusion import block_diffusion_settings
from gr2model.diffusion_decode import diffusion_generate
from gr2model.rerank_eval import LMRerankResult, lm_rerank, mean_explanation_nll, speculative_kwargs
from gr2model.rerank_format import FormatConfig, ItemText, rerank_metrics
from gr2model.speculative import SpeculativeDecodeOutput

log = logging.getLogger(__name__)

SPEED_FIELDS = (
    "decoder", "model", "tau", "sub_block_size", "sub_block_cache", "explanation_tau", "explanation_sub_block_size", "batch_size", "n", "seconds", "tokens_per_s", "speedup", "nfe_per_token",
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


def _row_forwards(out: LMRerankResult, attr: str = "nfe", batch_size: int = 1) -> int:
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
        "ar_forwards_per_token": _row_forwards(out, "ar_nfe") / tokens,
        "draft_forwards_per_token": _row_forwards(out, "draft_nfe") / tokens,
    }


def _row(
    decoder: str, model: str, tau: float | None, batch_size: int, out: LMRerankResult, targets: Sequence[int],
    sub_block_size: int | None = None, explanation_tau: float | None = None, explanation_sub_block_size: int | None = None,
    sub_block_cache: bool | None = None,
) -> dict[str, Any]:
    m = rerank_metrics(out.parsed, targets)
    tokens = max(out.generated_tokens, 1)
    return {
        "decoder": decoder,
        "model": model,
        "tau": tau,
        "sub_block_size": sub_block_size,
        "sub_block_cache": sub_block_cache,
        "explanation_tau": explanation_tau,
        "explanation_sub_block_size": explanation_sub_block_size,
        "batch_size": batch_size,
        "n": len(out.parsed),
        "seconds": out.seconds,
        "tokens_per_s": out.generated_tokens / max(out.seconds, 1e-9),
        "speedup": float("nan"),  # filled once the best AR decoder of this batch size is known
        "forward_cost": float("nan"),  # filled against our AR loop's row (`_relative_to`)
        "projected_speedup": float("nan"),
        "nfe_per_token": _row_forwards(out, batch_size=batch_size) / tokens,
        "tokens_per_forward": tokens / max(_row_forwards(out, batch_size=batch_size), 1),
        "response_tokens": out.generated_tokens / max(len(out.parsed), 1),
        "recall@1": m["recall@1"],
        "ndcg@3": m["ndcg@3"],
        "valid_format_rate": m["valid_format_rate"],
        "valid_permutation_rate": m["valid_permutation_rate"],
        "grammar_changed_rate": out.grammar_changed_rate,
        **dict.fromkeys(SPEC_FIELDS),
    }


def _relative_to(row: dict[str, Any], out: LMRerankResult, best_ar: float, ar: tuple[float, float]) -> dict[str, Any]:
    """Fill the row's speedup, forward_cost and projected_speedup (module docstring).

    best_ar: the faster AR decoder's tokens/s; ar: our AR loop's (seconds per
    batch forward, tokens_per_forward) at the same batch size. Returns the row.
    """
    ar_step, ar_tpf = ar
    row["speedup"] = row["tokens_per_s"] / best_ar
    row["forward_cost"] = (out.seconds / max(out.nfe, 1)) / ar_step if ar_step > 0 else float("nan")
    row["projected_speedup"] = row["tokens_per_forward"] / ar_tpf
    return row


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
    explanation_taus: Sequence[float] = (),
    explanation_sub_block_size: int | None = None,
    scorer: PreTrainedModel | None = None,
) -> list[dict[str, Any]]:
    """Decode `lists` with every decoder, threshold and batch size; one row each (module docstring).

    Args:
        ar_model: the AR re-ranker (eval mode).
        diffusion_models: name -> converted model (block size and mask id read
            from its config), all sharing `tok`.
        lists: re-ranking examples (history, candidates, target), the same for
            every decoder.
        taus: commit thresholds of the diffusion decoder.
        batch_sizes: batch sizes to measure (AR and diffusion alike).
        on_row: called with each row as soon as it is measured (progress).
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
            window (`draft_mode`, `gr2model.speculative.diffusion_drafter`). None: no such rows.
        constrained: decode the diffusion rows under the answer grammar
            (`gr2model.constrained`; their grammar_changed_rate says how many
            answers it changed). The AR rows stay unconstrained: the faster AR
            decoder is the reference, and GR2's answers are valid anyway.
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
    Returns:
        The rows, AR first within each batch size, then diffusion, then
        speculative; `speedup` is relative to the faster of "ar" and "hf" at
        the same batch size.
    """
    if any(s < 1 for s in sub_block_sizes):
        raise ValueError(f"sub_block_sizes must be >= 1, got {list(sub_block_sizes)}")
    if not set(sub_block_cache_sizes) <= set(sub_block_sizes):
        raise ValueError(f"sub_block_cache_sizes {list(sub_block_cache_sizes)} must be among sub_block_sizes {list(sub_block_sizes)}")
    drafters = drafters or {}
    if drafters and (draft_len < 1 or draft_steps < 1):
        raise ValueError(f"draft_len and draft_steps must be >= 1, got {draft_len}, {draft_steps}")
    targets = lists["target"].to_list()
    rows: list[dict[str, Any]] = []
    for bs in batch_sizes:
        common = {"batch_size": bs, "max_new_tokens": max_new_tokens}
        batch_rows = []
        ar_outs = {}
        for decoder_name, decoder in (("ar", ar_generate), ("hf", hf_generate)):
            ar_outs[decoder_name] = lm_rerank(ar_model, tok, lists, items, fmt, decoder=decoder, desc=f"bench {decoder_name} b{bs}", **common)
            batch_rows.append(_row(decoder_name, ar_name, None, bs, ar_outs[decoder_name], targets))
        ar_sequences = ar_outs["ar"].sequences  # our AR loop's tokens: what the speculative rows must reproduce
        best_ar = max(r["tokens_per_s"] for r in batch_rows)
        ar = (ar_outs["ar"].seconds / max(ar_outs["ar"].nfe, 1), batch_rows[0]["tokens_per_forward"])
        for r, out in zip(batch_rows, ar_outs.values(), strict=True):
            _relative_to(r, out, best_ar, ar)
            if scorer is not None:
                r["explanation_nll_gr2"] = mean_explanation_nll(scorer, tok, lists, items, fmt, out.sequences)
            if on_row:
                on_row(r)  # after the speed-up is known
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
                    variants: list[tuple[float | None, bool]] = [
                        (e, False) for e in [None, *(e for e in explanation_taus if constrained and (e < tau or (e == tau and equal_ok)))]
                    ]
                    if sub in sub_block_cache_sizes and sub < block_size:
                        variants.append((None, True))
                    for expl, cached in variants:
                        tag = ("" if sub is None else f" s{sub}") + ("" if expl is None else f" e{expl}") + (" cache" if cached else "")
                        extra: dict[str, Any] = {"sub_block_cache": True} if cached else {}
                        if expl is not None:
                            extra["explanation_threshold"] = expl
                            if explanation_sub_block_size is not None and block_size % explanation_sub_block_size == 0:
                                extra["explanation_sub_block_size"] = explanation_sub_block_size
                        out = lm_rerank(
                            model, tok, lists, items, fmt, decoder=diffusion_generate,
                            desc=f"bench {name} tau {tau}{tag} b{bs}", mask_id=mask_id, block_size=block_size,
                            threshold=tau, sub_block_size=sub, constrained=constrained, **extra, **common,
                        )  # fmt: skip
                        row = _row(
                            "diffusion", name, tau, bs, out, targets, sub_block_size=sub, explanation_tau=expl,
                            explanation_sub_block_size=extra.get("explanation_sub_block_size"), sub_block_cache=cached,
                        )  # fmt: skip
                        if scorer is not None:
                            row["explanation_nll_gr2"] = mean_explanation_nll(scorer, tok, lists, items, fmt, out.sequences)
                        batch_rows.append(_relative_to(row, out, best_ar, ar))
                        if on_row:
                            on_row(row)
        for name, drafter_model in drafters.items():
            out = lm_rerank(
                ar_model, tok, lists, items, fmt, desc=f"bench spec {name} k{draft_len} b{bs}",
                **speculative_kwargs(drafter_model, draft_steps, draft_len, draft_mode), **common,
            )  # fmt: skip
            row = _relative_to(_row("spec", name, None, bs, out, targets), out, best_ar, ar)
            row.update(
                draft_len=draft_len, draft_steps=draft_steps, draft_mode=draft_mode,
                equal_to_gr2=equal_share(out.sequences, ar_sequences), **speculative_stats(out),
            )  # fmt: skip
            batch_rows.append(row)
            if on_row:
                on_row(row)
        rows.extend(batch_rows)
    return rows


def speed_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a markdown table (the benchmark's printed and reported form).

    A sub_block_size column only when some row has one (sub_block_cache when
    some row takes the cache), and the speculative
    columns only when some row is speculative (the default table is unchanged).
    """
    cols: tuple[str, ...] = ("decoder", "model", "tau", "batch_size", "tokens_per_s", "speedup", "nfe_per_token", "forward_cost", "projected_speedup", "response_tokens", "recall@1", "valid_format_rate")
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
            cells.append("-" if v is None else f"{v:.3f}" if isinstance(v, float) and c not in ("tokens_per_s",) else f"{v:.0f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
