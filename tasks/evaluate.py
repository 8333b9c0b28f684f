"""Stage `evaluate`: every re-ranker and baseline on the validation and test re-ranking examples.

Baselines: `prerank` (the incoming order), `teacher` (the expert teacher's own
ranking, without the target), `random` (a seeded shuffle). Models: every AR
checkpoint that exists among `AR_MODELS`, decoded greedily with our KV-cache
loop; `dgr2-naive` (GR2's weights converted to block diffusion, no training)
and every diffusion checkpoint among `DIFFUSION_MODELS`, decoded greedily by
the threshold decoder at `tau`. All are judged by the shared parser (an invalid
answer falls back to the incoming order and is counted). Then, unless
`spec_row` is false, `spec-<drafter>`: GR2 verifying what the first existing
diffusion model of `spec_drafter` drafts (speculative decoding, greedy), on the
diffusion rows' examples; its answers are GR2's by construction and
`equal_to_gr2_rate` checks it against the gr2 row's tokens. Writes
`metrics/evaluate.json` as `{model: {split: {metric: value}}}`,
`reports/evaluate.md`, and every LM row's ranking of every example in
`reports/rankings.parquet` (what `gr2 serve-check` compares a served version with).

Then the decode-speed benchmark (gr2model.eval.bench) on the first `bench.examples`
test examples: GR2 with both AR decoders against every diffusion model at each
threshold and batch size, and GR2 verifying each of `bench.spec_models`'
drafts, written to `metrics/speed.json` and `reports/speed.md` (also runnable
alone: `gr2 bench decode`).

    python -m tasks.evaluate
    accelerate launch --multi_gpu --num_processes N -m tasks.evaluate   # or GR2_LAUNCH=...

Under N processes the accuracy rows' decoding is shared (`lm_rerank(state=)`) and
gives the same answers as one process; the speed benchmark runs on the main process.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import polars as pl
import torch
from accelerate import PartialState

from gr2model.eval.bench import SPEED_FIELDS, decode_benchmark, equal_share, row_forwards, speculative_stats, speed_table
from gr2model.models.block_diffusion import block_diffusion_settings, convert_to_block_diffusion
from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.decoding.constrained import covers
from gr2model.data.dataset import load_prepared
from gr2model.eval.rerank_eval import (
    LMRerankResult, decoder_kwargs, fixed_rankings, lm_rerank, mean_explanation_nll, random_rankings, rerank_examples,
    speculative_kwargs,
)  # fmt: skip
from gr2model.task.metrics import bootstrap_ci, per_example_gain
from gr2model.task.rerank_format import (
    RERANK_METRIC_NAMES, FormatConfig, ItemText, ParsedResponse, no_reasoning_prefix, rerank_metrics, target_ranks,
)  # fmt: skip
from gr2model.teachers.ltr_teacher import LTRConfig, LTRTeacher
from gr2model.teachers.teacher import ExpertTeacher
from tasks.results import GRAMMAR_SUFFIX, diffusion_ladder  # `<model>+grammar`: decoded under the answer grammar
from tasks.traces import load_format, load_lists
from tasks.common import Cap, Count, Seed, StageConfig, Unit, process_state, stage_main, timed, write_json_atomic, write_text_atomic
from tasks.tracking import StageTracker

STAGE = "evaluate"
PREPARED = Path("data/prepared")
TRACES = Path("data/traces")
METRICS = Path("metrics/evaluate.json")
REPORT = Path("reports/evaluate.md")
SPEED = Path("metrics/speed.json")
SPEED_REPORT = Path("reports/speed.md")
# Every LM row's parsed ranking of every example (`write_rankings`): what a served version's answers are checked against.
RANKINGS = Path("reports/rankings.parquet")
RANKINGS_SCHEMA = {"row": pl.String, "split": pl.String, "example": pl.Int64, "user_id": pl.Int64, "ranking": pl.List(pl.Int64), "valid": pl.Boolean}
# Model name in metrics/evaluate.json -> checkpoint folder (the contract in ARCHITECTURE.md).
AR_MODELS: dict[str, Path] = {"gr2-sft": Path("checkpoints/gr2-sft"), "gr2": Path("checkpoints/gr2")}
GR2 = AR_MODELS["gr2"]
NAIVE = "dgr2-naive"  # GR2 converted without training: the structural gap that CFT closes
# GR2 with its explanation forced empty (`no_reasoning_prefix`), then its own answer: what the reasoning is worth.
NO_REASONING = "gr2-no-reasoning"
DIFFUSION_MODELS: dict[str, Path] = {
    "dgr2-cft": Path("checkpoints/dgr2-cft"),
    "dgr2-opd": Path("checkpoints/dgr2-opd"),
    "dgr2": Path("checkpoints/dgr2"),
}
SPEC_PREFIX = "spec-"  # `spec-<drafter>`: GR2 verifying that diffusion model's drafts (ARCHITECTURE.md)
# The paper's ablation: each row adds one stage to the one before it.
ABLATION = ("prerank", "gr2", NO_REASONING, NAIVE, *DIFFUSION_MODELS)
ABLATION_METRICS = (
    "recall@1", "recall@3", "ndcg@3", "valid_format_rate", "valid_permutation_rate", "copy_incoming_rate", "top1_agreement_vs_gr2",
    "grammar_changed_rate", "explanation_nll_gr2",
)  # fmt: skip
BASELINES = ("prerank", "teacher", "random")  # fixed rankings, no language model
# Metrics that get a bootstrap interval and paired differences (the contract in ARCHITECTURE.md).
CI_METRICS = ("recall@1", "ndcg@3")


class BenchParams(StageConfig):
    taus: list[Unit] = [0.9, 0.7, 0.5, 0.3]
    batch_sizes: list[Count] = [1, 16]
    examples: Count = 64  # the first N test re-ranking examples (the same for every decoder)
    models: list[str] = ["dgr2-cft", "dgr2"]  # diffusion models raced against GR2 (those that exist)
    sub_block_sizes: list[Count] = []  # extra diffusion rows decoding sub-block by sub-block (each must divide the block)
    # Besides the sub-block rows of these sizes (among sub_block_sizes), one more each decoded with the
    # approximate sub-block cache (gr2model.decoding.diffusion_decode's sub_block_cache).
    sub_block_cache_sizes: list[Count] = []
    # Extra diffusion rows decoding the explanation at each of these thresholds (those below the
    # row's tau; decoded under the answer grammar when evaluate.grammar_rows).
    explanation_taus: list[Unit] = []
    explanation_sub_block_size: Count | None = None  # those rows' sub-block size past the answer (null: the row's)
    # Speculative rows: GR2 verifies what each of these diffusion models drafts (those that exist).
    spec_models: list[str] = ["dgr2"]
    spec_draft_len: Count = 32  # tokens drafted per round (the drafter stops at its block end anyway)
    spec_steps: Count = 1  # denoising forwards of the drafter per round
    # Where the drafter drafts: "block", on its own blocks (each round's forward covers the active
    # block); "window", a window of spec_draft_len masks after the accepted tokens, which it caches
    # as fed (a forward over about accepted + spec_draft_len positions; gr2model.decoding.speculative).
    spec_draft_mode: Literal["block", "window"] = "block"
    # Timed passes per row after an untimed warm-up, interleaved across rows (gr2model.eval.bench): a row's
    # seconds are their median, with the spread (seconds_min, seconds_max) beside it.
    repeats: Count = 3


class EvaluateConfig(StageConfig):
    splits: list[str] = ["valid", "test"]
    batch_size: Count = 32
    max_new_tokens: Count = 320
    max_examples: Cap = 0  # per split; 0 = every re-ranking example
    # The diffusion rows on the first N of those (0 = all of them): their threshold decoder
    # costs ~4x GR2's per example on 2 cores. Their paired differences use the same N.
    diffusion_max_examples: Cap = 0
    seed: Seed = 0
    bootstrap: Count = 2000  # resamples of the examples for every interval (paired for differences)
    tau: Unit = 0.9  # commit threshold of the diffusion decoder in the accuracy table
    # Every row decodes as the model is served, without a grammar: its validity is what it wrote.
    # grammar_rows adds, for each LM row, a labelled `<model>+grammar` row decoded under the answer
    # grammar (gr2model.decoding.constrained; the rank-first index format only), with `grammar_changed_rate`.
    grammar_rows: bool = False
    # The +grammar diffusion rows' threshold after the answer (the explanation); null: tau.
    explanation_tau: Unit | None = None
    # Their sub-block size in the blocks past the answer; null: sub_block_size.
    explanation_sub_block_size: Count | None = None
    # The accuracy table's diffusion decoder commits within sub-blocks of this size; that it divides
    # the block size is checked at decode time (the block size is the checkpoint's, not a param here).
    sub_block_size: Count | None = None
    # The accuracy table's diffusion rows with the approximate sub-block cache (Fast-dLLM v2; it changes
    # the tokens: a sub-block's later steps forward the sub-block alone; gr2model.decoding.diffusion_decode).
    sub_block_cache: bool = False
    naive_block_size: Count = 32  # block size of dgr2-naive when no diffusion checkpoint says otherwise
    # The `spec-<drafter>` row: GR2 verifies the drafts of the first of these diffusion models that
    # exists (drafting with bench.spec_draft_len and bench.spec_steps), on the diffusion rows' examples.
    spec_row: bool = True
    spec_drafter: list[str] = ["dgr2"]
    bench: BenchParams = BenchParams()


CONFIG = EvaluateConfig


def load_teacher(
    root: Path, items_table: pl.DataFrame, train_seqs: list[list[int]], num_items: int, folds: Sequence[int] | None = None
) -> ExpertTeacher | LTRTeacher:
    """The teacher `traces` wrote (data/traces/teacher.json, and teacher_ltr.txt for the LTR teacher).

    folds: each training user's cross-fitting fold (`tasks.traces.user_folds_from_lists`),
        for scoring training lists as `traces` did (co-purchase counts without the
        list's own fold); None for validation and test lists.
    """
    path = root / TRACES / "teacher.json"
    info = json.loads(path.read_text())
    expert = ExpertTeacher(items_table, train_seqs, num_items, folds=folds)
    expert.set_weights(info["weights"], info["evidence_weights"])
    if info.get("teacher", "linear") == "linear":
        return expert
    if "ltr" not in info:
        raise ValueError(f"{path}: teacher {info['teacher']!r} without its 'ltr' section")
    teacher = LTRTeacher(expert, LTRConfig(**info["ltr"]["config"]))
    teacher.load_model_text((root / TRACES / info["ltr"]["model"]).read_text())
    return teacher


def teacher_rankings(teacher: ExpertTeacher | LTRTeacher, lists: pl.DataFrame) -> list[list[int]]:
    """The teacher's ranking of each list from its scores alone (it does not see the target)."""
    out = []
    for hist, cands, scores in zip(lists["history"].to_list(), lists["candidates"].to_list(), lists["cand_scores"].to_list(), strict=True):
        order = np.argsort(-teacher.score(hist, cands, scores), kind="stable")
        out.append([cands[i] for i in order])
    return out


def markdown_table(
    results: dict[str, dict[str, dict[str, float]]], split: str, models: Sequence[str] | None = None, cols: Sequence[str] = RERANK_METRIC_NAMES
) -> str:
    """One split of the results as a markdown table, models as rows (all, or `models` in that order)."""
    lines = [f"| model | {' | '.join(cols)} |", f"|---|{'---|' * len(cols)}"]
    for model in models if models is not None else list(results):
        by_split = results.get(model, {})
        if split in by_split:
            m = by_split[split]
            lines.append(f"| {model} | " + " | ".join(f"{m[c]:.4f}" if c != "n" else str(int(m[c])) for c in cols) + " |")
    return "\n".join(lines)


def diffusion_models(root: Path, naive_block_size: int) -> dict[str, Any]:
    """name -> (model, tokenizer) of every diffusion re-ranker to evaluate: the naive conversion of GR2 and each checkpoint.

    The naive conversion uses the block size of the first diffusion checkpoint
    (so the two rows differ by training alone), or `naive_block_size` when
    there is none yet.
    """
    found = {name: load_hf_checkpoint(root / path) for name, path in DIFFUSION_MODELS.items() if (root / path).exists()}
    block_size = next((block_diffusion_settings(m)[0] for m, _ in found.values()), naive_block_size)
    gr2, tok = load_hf_checkpoint(root / GR2)
    return {NAIVE: (convert_to_block_diffusion(gr2, tok, block_size), tok), **found}


def scored(parsed: Sequence[ParsedResponse], targets: Sequence[int]) -> tuple[dict[str, float], np.ndarray]:
    """(the metrics of `rerank_metrics`, (n,) per-example target ranks for the intervals)."""
    return rerank_metrics(parsed, targets), target_ranks(parsed, targets)


def paired_difference(ranks: np.ndarray, ref_ranks: np.ndarray, metric: str, *, n_boot: int, seed: int) -> dict[str, Any]:
    """{"diff": mean gain - mean reference gain, "ci95": [lo, hi]} of `metric`, paired bootstrap.

    ranks, ref_ranks: (n,) per-example target ranks of two models on the same
    examples in the same order (`scored`).
    """
    return paired_gain_difference(per_example_gain(ranks, metric), per_example_gain(ref_ranks, metric), n_boot=n_boot, seed=seed)


def paired_gain_difference(gain: np.ndarray, base: np.ndarray, *, n_boot: int, seed: int) -> dict[str, Any]:
    """{"diff": mean(gain) - mean(base), "ci95": [lo, hi]}, the paired bootstrap over examples.

    gain, base: (n,) per-example gains (`per_example_gain`) of two rankers on the same examples."""
    lo, hi = bootstrap_ci(gain, baseline=base, n_boot=n_boot, seed=seed)
    return {"diff": float(gain.mean() - base.mean()), "ci95": [lo, hi]}


def add_intervals(
    results: dict[str, dict[str, dict[str, Any]]], ranks: dict[str, dict[str, np.ndarray]], *, n_boot: int, seed: int
) -> None:
    """Add `<metric>_ci95` ([lo, hi], bootstrap over examples) for every model and
    split, paired `<metric>_vs_prerank` for every model but prerank, and
    `<metric>_vs_gr2` for every LM row but gr2's own ({"diff": d, "ci95": [lo, hi]}),
    for each metric of CI_METRICS. Every model of a split was scored on the same
    examples in the same order, which is what pairing needs."""
    for model, by_split in ranks.items():
        for split, r in by_split.items():
            m = results[model][split]
            for metric in CI_METRICS:
                gain = per_example_gain(r, metric)
                m[f"{metric}_ci95"] = list(bootstrap_ci(gain, n_boot=n_boot, seed=seed))
                refs = ["prerank"] if model != "prerank" else []
                if model not in (*BASELINES, "gr2") and "gr2" in ranks:
                    refs.append("gr2")
                for ref in refs:
                    # A model scored on fewer examples (diffusion_max_examples) saw the first len(r).
                    m[f"{metric}_vs_{ref}"] = paired_difference(r, ranks[ref][split][: len(r)], metric, n_boot=n_boot, seed=seed)


def top1_agreement(firsts: Sequence[int], reference: Sequence[int]) -> float:
    """The share of examples whose first item equals the reference's on the same example
    (`firsts` may cover only the first len(firsts) of `reference`'s examples)."""
    if not firsts:
        return float("nan")
    if len(firsts) > len(reference):
        raise ValueError(f"{len(firsts)} first items against {len(reference)} reference ones")
    return float(np.mean([a == b for a, b in zip(firsts, reference)]))


def add_agreement(results: dict[str, dict[str, dict[str, Any]]], firsts: dict[str, dict[str, list[int]]]) -> None:
    """Add `top1_agreement_vs_gr2` to every LM row but gr2's own, per split: the share of
    examples whose first item (as parsed: an invalid answer's is the incoming first) is GR2's."""
    ref = firsts.get("gr2")
    if not ref:
        return
    for model, by_split in firsts.items():
        if model == "gr2":
            continue
        for split, f in by_split.items():
            if split in ref:
                results[model][split]["top1_agreement_vs_gr2"] = top1_agreement(f, ref[split])


def ablation_table(results: dict[str, dict[str, dict[str, Any]]], split: str) -> str:
    """The ablation rows (ABLATION order) of one split: metrics, R@1 and NDCG@3 with
    their 95% intervals and their paired differences to the pre-rank order."""
    head = [*ABLATION_METRICS, "R@1 95% CI", "R@1 - prerank [95% CI]", "NDCG@3 - prerank [95% CI]", "R@1 - gr2 [95% CI]", "n"]
    lines = [f"| model | {' | '.join(head)} |", f"|---|{'---|' * len(head)}"]

    def diff(m: dict[str, Any], key: str) -> str:
        d = m.get(key)
        return f"{d['diff']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]" if d else "-"

    for model in (*ABLATION, *(a + GRAMMAR_SUFFIX for a in ABLATION)):
        m = results.get(model, {}).get(split)
        if m is None:
            continue
        ci = m.get("recall@1_ci95")
        cells = [f"{m[c]:.4f}" if c in m else "-" for c in ABLATION_METRICS]
        cells += [f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "-", diff(m, "recall@1_vs_prerank"), diff(m, "ndcg@3_vs_prerank"), diff(m, "recall@1_vs_gr2"), str(int(m["n"]))]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _decode_eval(
    name: str, model: Any, tok: Any, df: pl.DataFrame, items: ItemText, fmt: Any, cfg: EvaluateConfig,
    kwargs: dict[str, Any] | None = None, state: PartialState | None = None, *, constrained: bool = False,
    response_prefix: str = "",
) -> tuple[dict[str, float], np.ndarray, LMRerankResult]:
    """Decode one split with the model's decoder (AR or threshold diffusion; `kwargs` for another,
    e.g. `speculative_kwargs`); its metrics, per-example ranks and the decode itself.
    With `state` of several processes, they share the batches (`lm_rerank`): the same answers.

    constrained: under the answer grammar (a `+grammar` row; its explanation settings apply).
    response_prefix: forced at the start of every response (`lm_rerank`).
    """
    if kwargs is None:
        # The explanation's own threshold and sub-blocks need the grammar (it knows where the answer ends).
        kwargs = decoder_kwargs(
            model, cfg.tau, sub_block_size=cfg.sub_block_size,
            explanation_threshold=cfg.explanation_tau if constrained else None,
            explanation_sub_block_size=cfg.explanation_sub_block_size if constrained else None,
            sub_block_cache=cfg.sub_block_cache,
        )  # fmt: skip
    out = lm_rerank(
        model, tok, df, items, fmt, batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens, desc=name, state=state,
        constrained=constrained, response_prefix=response_prefix, **kwargs,
    )  # fmt: skip
    m, ranks = scored(out.parsed, df["target"].to_list())
    m["tokens_per_s"] = out.generated_tokens / max(out.seconds, 1e-9)
    m["response_tokens"] = out.generated_tokens / max(len(out.parsed), 1)
    # Hardware-independent: tokens one row gets per forward it waits for (a batch forward serves every row).
    m["tokens_per_forward"] = out.generated_tokens / max(row_forwards(out), 1)
    if constrained:
        m["grammar_changed_rate"] = out.grammar_changed_rate
    return m, ranks, out


def decoding_note(cfg: EvaluateConfig) -> str:
    """How the LM rows were decoded, for the report's headings."""
    note = f"diffusion at tau {cfg.tau}"
    if cfg.grammar_rows and cfg.explanation_tau is not None:
        note += f" (+grammar rows: explanation {cfg.explanation_tau})"
    if cfg.grammar_rows and cfg.explanation_sub_block_size is not None:
        note += f", +grammar rows: explanation sub-blocks of {cfg.explanation_sub_block_size}"
    if cfg.sub_block_size is not None:
        note += f", sub-blocks of {cfg.sub_block_size}"
    if cfg.sub_block_cache:
        note += " with the approximate sub-block cache"
    note += "; every row without a grammar (its validity is what it wrote)"
    if cfg.grammar_rows:
        note += f"; `<model>{GRAMMAR_SUFFIX}` rows under the answer grammar (grammar_changed_rate: the answers it changed)"
    note += "; explanation_nll_gr2: GR2's mean NLL per explanation token"
    return note


def pick_spec_drafter(names: Sequence[str], available: Iterable[str]) -> str | None:
    """The spec row's drafter: the first of `names` among the `available` diffusion models (None: none is)."""
    have = set(available)
    return next((n for n in names if n in have), None)


def spec_eval(
    name: str, gr2: Any, drafter: Any, tok: Any, df: pl.DataFrame, items: ItemText, fmt: Any, cfg: EvaluateConfig,
    reference: Sequence[Sequence[int]], state: PartialState | None = None,
) -> tuple[dict[str, float], np.ndarray, list[ParsedResponse]]:
    """The speculative row on one split: GR2 verifies `drafter`'s drafts (greedy, `cfg.bench.spec_draft_len`
    tokens per round in `cfg.bench.spec_steps` forwards); its metrics, per-example ranks and parsed answers
    (kept in `reports/rankings.parquet`, as every LM row's, for `gr2 serve-check spec-gr2@...`).

    The metrics add `equal_to_gr2_rate` (the share of examples whose tokens equal
    `reference`, GR2's greedy tokens on the same examples in the same order),
    `mean_accepted_length`, `ar_forwards_per_token`, `draft_forwards_per_token`
    (`gr2model.eval.bench.speculative_stats`), `draft_len`, `draft_steps` and `draft_mode`.
    """
    kwargs = speculative_kwargs(drafter, cfg.bench.spec_steps, cfg.bench.spec_draft_len, cfg.bench.spec_draft_mode)
    m, ranks, out = _decode_eval(name, gr2, tok, df, items, fmt, cfg, kwargs, state)
    m["equal_to_gr2_rate"] = equal_share(out.sequences, reference)
    m.update(
        speculative_stats(out), draft_len=cfg.bench.spec_draft_len, draft_steps=cfg.bench.spec_steps,
        draft_mode=cfg.bench.spec_draft_mode,
    )  # fmt: skip
    return m, ranks, list(out.parsed)


def spec_report(results: dict[str, dict[str, dict[str, Any]]], splits: Sequence[str]) -> str:
    """The check of each speculative row: its answers against GR2's, and what drafting bought (markdown, "" when none)."""
    lines = []
    for model in (m for m in results if m.startswith(SPEC_PREFIX)):
        for split in splits:
            m = results[model].get(split)
            if m is None:
                continue
            lines.append(
                f"- {model} ({split}, {int(m['n'])} examples): tokens equal to GR2's greedy answers on "
                f"{m['equal_to_gr2_rate']:.4f} of them; {m['mean_accepted_length']:.2f} draft tokens accepted per "
                f"verification (draft length {m['draft_len']}, {m['draft_steps']} drafter steps, "
                f"{m.get('draft_mode', 'block')} drafting); per token "
                f"{m['ar_forwards_per_token']:.3f} GR2 and {m['draft_forwards_per_token']:.3f} drafter forwards"
            )
    if not lines:
        return ""
    return "## Speculative decoding (GR2 verifies a diffusion model's drafts; greedy)\n\n" + "\n".join(lines)


def speed_metric_key(row: dict[str, Any]) -> str:
    """The MLflow key of a benchmark row's speed-up: `speed.<model>.<decoder>.tau<tau>.b<batch>[.s<sub-block>]`."""
    tau = row["tau"] if row["tau"] is not None else "-"
    sub = f".s{row['sub_block_size']}" if row.get("sub_block_size") else ""
    sub += f".e{row['explanation_tau']}" if row.get("explanation_tau") is not None else ""
    sub += f".es{row['explanation_sub_block_size']}" if row.get("explanation_sub_block_size") is not None else ""
    sub += ".cache" if row.get("sub_block_cache") else ""
    sub += ".grammar" if row.get("grammar") else ""  # else a grammar row and its plain twin would share a key
    return f"speed.{row['model']}.{row['decoder']}.tau{tau}.b{row['batch_size']}{sub}.speedup"


def mark_every_example(rows: list[dict[str, Any]], results: dict[str, dict[str, dict[str, Any]]], cfg: EvaluateConfig) -> None:
    """Give the bench rows that decode as the accuracy table does (same model, tau, sub-block and
    explanation threshold) the accuracy table's judgement, measured on every example:
    `every_example_recall@1_vs_gr2` (the lowest over the splits of the paired R@1 difference to
    GR2) and `every_example_valid_format_rate` (the lowest over the splits). The parity point
    (tasks/report.py) prefers them to the bench's few examples, which cannot resolve 0.005."""
    for r in rows:
        if r["decoder"] != "diffusion" or r["model"] not in results:
            continue
        # The accuracy table's headline rows decode without a grammar, so without its explanation settings.
        setting = (r["tau"], r.get("sub_block_size"), r.get("explanation_tau"), r.get("explanation_sub_block_size"), bool(r.get("sub_block_cache")))
        grammar = r.get("grammar", r.get("grammar_changed_rate") is not None)  # rows before the field: the rate says
        if grammar or setting != (cfg.tau, cfg.sub_block_size, None, None, cfg.sub_block_cache):
            continue
        by_split = [m for m in results[r["model"]].values() if "recall@1_vs_gr2" in m]
        if by_split:
            r["every_example_recall@1_vs_gr2"] = min(m["recall@1_vs_gr2"]["diff"] for m in by_split)
            r["every_example_valid_format_rate"] = min(m["valid_format_rate"] for m in by_split)


def bench_inputs(root: Path, examples: int) -> tuple[FormatConfig, ItemText, pl.DataFrame]:
    """What the decode benchmark races on in a workspace: the traces' prompt format, the item texts and
    the first `examples` test re-ranking examples (also the decode experiments' inputs)."""
    ds, _ = load_prepared(root / PREPARED)
    return load_format(root), ItemText(ds.items), rerank_examples(load_lists(root, "test")).head(examples)


def run_bench(
    cfg: EvaluateConfig, root: Path, log: logging.Logger, models: dict[str, Any] | None = None,
    results: dict[str, dict[str, dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """The decode-speed benchmark on the first `cfg.bench.examples` test examples; writes metrics/speed.json and reports/speed.md.

    Args:
        models: the diffusion models to race (`diffusion_models`); loaded when None.
        results: the accuracy table (with its paired intervals), for `mark_every_example`.
    """
    fmt, items, lists = bench_inputs(root, cfg.bench.examples)
    gr2, tok = load_hf_checkpoint(root / GR2)
    models = models if models is not None else diffusion_models(root, cfg.naive_block_size)
    # Every racer on the same device (the GPU when there is one), as the accuracy rows decode.
    on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gr2 = gr2.to(on)
    racers = {name: models[name][0].to(on) for name in cfg.bench.models if name in models}
    drafters = {name: models[name][0].to(on) for name in cfg.bench.spec_models if name in models}
    log.info(
        "decode benchmark: %d test examples, AR (ours, HF) vs %s at tau %s, GR2 verifying the drafts of %s (k=%d, %d steps, %s drafting), batch sizes %s",
        lists.height, list(racers), cfg.bench.taus, list(drafters), cfg.bench.spec_draft_len, cfg.bench.spec_steps, cfg.bench.spec_draft_mode, cfg.bench.batch_sizes,
    )  # fmt: skip

    def on_row(r: dict[str, Any]) -> None:
        log.info("bench %s %s tau=%s sub-block %s explanation %s grammar %s b%d: %.4f s/example (%d passes, %.3f-%.3f s), %.2fx, %.0f tok/s, %.3f NFE/token, R@1 %.4f, valid %.3f", r["decoder"], r["model"], r["tau"], r.get("sub_block_size"), r.get("explanation_tau"), r.get("grammar"), r["batch_size"], r["seconds_per_example"], r["repeats"], r["seconds_min"], r["seconds_max"], r["speedup"], r["tokens_per_s"], r["nfe_per_token"], r["recall@1"], r["valid_format_rate"])
        if r["decoder"] == "spec":
            log.info("bench spec %s b%d: %.2f accepted per verification, %.3f GR2 + %.3f drafter forwards per token, equal to GR2 on %.3f", r["model"], r["batch_size"], r["mean_accepted_length"], r["ar_forwards_per_token"], r["draft_forwards_per_token"], r["equal_to_gr2"])

    # The accuracy table's setting is the one a diffusion version is registered to serve (flows/registry.py),
    # and its speed gate reads the bench row of exactly that setting: always measure it, without a grammar.
    served = (cfg.tau, cfg.sub_block_size, cfg.sub_block_cache)
    taus = list(dict.fromkeys([*cfg.bench.taus, cfg.tau]))
    subs = list(dict.fromkeys([*cfg.bench.sub_block_sizes, *([cfg.sub_block_size] if cfg.sub_block_size is not None else [])]))
    cached = list(dict.fromkeys([*cfg.bench.sub_block_cache_sizes, *([cfg.sub_block_size] if cfg.sub_block_cache and cfg.sub_block_size is not None else [])]))
    rows = decode_benchmark(
        gr2, racers, tok, lists, items, fmt, taus=taus, batch_sizes=cfg.bench.batch_sizes,
        max_new_tokens=cfg.max_new_tokens, on_row=on_row, sub_block_sizes=tuple(subs),
        sub_block_cache_sizes=tuple(cached),
        drafters=drafters, draft_len=cfg.bench.spec_draft_len, draft_steps=cfg.bench.spec_steps,
        draft_mode=cfg.bench.spec_draft_mode, constrained=cfg.grammar_rows and covers(fmt), plain_settings=(served,),
        explanation_taus=tuple(cfg.bench.explanation_taus),
        explanation_sub_block_size=cfg.bench.explanation_sub_block_size, scorer=gr2,
        repeats=cfg.bench.repeats,
    )  # fmt: skip
    if results:
        mark_every_example(rows, results, cfg)
    device = "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    header = {"device": device, "threads": torch.get_num_threads(), "examples": lists.height, "repeats": cfg.bench.repeats}
    write_json_atomic({**header, "fields": list(SPEED_FIELDS), "rows": rows}, root / SPEED)
    table = speed_table(rows)
    write_text_atomic(f"# Decode speed ({device}, {torch.get_num_threads()} threads, {lists.height} test examples)\n\n{table}\n", root / SPEED_REPORT)
    return rows


def run(cfg: EvaluateConfig, root: Path, log: logging.Logger, tracker: StageTracker) -> dict[str, Any]:
    """Evaluate every baseline and existing checkpoint, then the speed benchmark; returns `{model: {split: metrics}}`.

    Under several processes they share every model's decoding (`lm_rerank(state=)`: the
    same answers as one process); the main process alone computes the intervals,
    writes the reports and runs the speed benchmark (timings of one device).
    """
    torch.manual_seed(cfg.seed)
    state = process_state()
    timings: dict[str, float] = {}
    ds, split = load_prepared(root / PREPARED)
    items = ItemText(ds.items)
    fmt = load_format(root)
    teacher = load_teacher(root, ds.items, split["train"].to_list(), ds.num_items)

    lists = {}
    for name in cfg.splits:
        df = rerank_examples(load_lists(root, name))
        lists[name] = df.head(cfg.max_examples) if cfg.max_examples else df
    results: dict[str, dict[str, dict[str, Any]]] = {b: {} for b in BASELINES}
    ranks: dict[str, dict[str, np.ndarray]] = {b: {} for b in BASELINES}
    for name, df in lists.items():
        incoming = df["candidates"].to_list()
        targets = df["target"].to_list()
        baselines = {
            "prerank": incoming,
            "teacher": teacher_rankings(teacher, df),
            "random": random_rankings(incoming, cfg.seed),
        }
        for baseline, rankings in baselines.items():
            results[baseline][name], ranks[baseline][name] = scored(fixed_rankings(rankings, incoming), targets)

    gr2_tokens: dict[str, list[list[int]]] = {}  # split -> the gr2 row's tokens, the spec row's reference
    answers: dict[str, dict[str, Sequence[ParsedResponse]]] = {}  # row -> split -> the parsed answers (agreement, `write_rankings`)
    # GR2 scores every LM row's explanations (`explanation_nll`): how much they read like its own.
    scorer = None
    if (root / GR2).exists() and state.is_main_process:
        scorer = load_hf_checkpoint(root / GR2)[0].eval()
    grammar = cfg.grammar_rows and covers(fmt)
    if cfg.grammar_rows and not grammar:
        log.warning("evaluate.grammar_rows: the answer grammar covers the rank-first index format only, not %s; no +grammar rows", fmt)

    def decode_row(row: str, model: Any, tok: Any, on: dict[str, pl.DataFrame], **how: Any) -> None:
        """One row of the table: `model` decoded on every split of `on` as `how` says (`_decode_eval`)."""
        results[row], ranks[row], answers[row] = {}, {}, {}
        for name, df in on.items():
            with timed(log, f"{row} on {name} ({df.height} examples)", timings, f"{row}_{name}_s"):
                results[row][name], ranks[row][name], out = _decode_eval(row, model.to(state.device), tok, df, items, fmt, cfg, state=state, **how)
            answers[row][name] = out.parsed
            if scorer is not None and not how.get("response_prefix"):
                with timed(log, f"{row} on {name}: explanations scored by GR2", timings, f"{row}_{name}_nll_s"):
                    nll = mean_explanation_nll(scorer, tok, df, items, fmt, out.sequences, batch_size=cfg.batch_size)
                if nll is not None:
                    results[row][name]["explanation_nll_gr2"] = nll
            if row == "gr2":
                gr2_tokens[name] = out.sequences
            log.info("%s %s: %s", row, name, {k: round(v, 4) for k, v in results[row][name].items()})

    def evaluate_model(model_name: str, model: Any, tok: Any, on: dict[str, pl.DataFrame]) -> None:
        """The model's headline row (no grammar), then its labelled extras: GR2 without its
        reasoning (reasoning-first formats), the `+grammar` row (when asked for)."""
        decode_row(model_name, model, tok, on)
        if model_name == "gr2" and not fmt.answer_first:
            decode_row(NO_REASONING, model, tok, on, response_prefix=no_reasoning_prefix(fmt))
        if grammar:
            decode_row(model_name + GRAMMAR_SUFFIX, model, tok, on, constrained=True)

    for model_name, ckpt in AR_MODELS.items():
        if not (root / ckpt).exists():
            log.info("%s: no checkpoint at %s; skipped", model_name, ckpt)
            continue
        model, tok = load_hf_checkpoint(root / ckpt)
        evaluate_model(model_name, model, tok, lists)
        del model
    models = diffusion_models(root, cfg.naive_block_size) if (root / GR2).exists() else {}
    diffusion_lists = {n: df.head(cfg.diffusion_max_examples) for n, df in lists.items()} if cfg.diffusion_max_examples else lists
    for model_name, (model, tok) in models.items():
        evaluate_model(model_name, model, tok, diffusion_lists)
    if cfg.spec_row:
        drafter = pick_spec_drafter(cfg.spec_drafter, models)
        if drafter is None or not gr2_tokens:
            log.info("spec row skipped: %s", "no gr2 row" if not gr2_tokens else f"no checkpoint of any drafter in evaluate.spec_drafter {cfg.spec_drafter}")
        else:
            gr2, gr2_tok = load_hf_checkpoint(root / GR2)
            spec_name = SPEC_PREFIX + drafter
            results[spec_name], ranks[spec_name], answers[spec_name] = {}, {}, {}
            for name, df in diffusion_lists.items():
                what = f"{spec_name} on {name} ({df.height} examples, GR2 verifying {drafter}'s drafts)"
                with timed(log, what, timings, f"{spec_name}_{name}_s"):
                    results[spec_name][name], ranks[spec_name][name], answers[spec_name][name] = spec_eval(
                        spec_name, gr2.to(state.device), models[drafter][0].to(state.device), gr2_tok, df, items, fmt, cfg,
                        gr2_tokens[name][: df.height], state,
                    )  # fmt: skip
                m = results[spec_name][name]
                log.info("%s %s: %s", spec_name, name, {k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()})
            del gr2
    if not state.is_main_process:  # its share of the decoding is done; the rest is the main process's
        return results

    with timed(log, f"bootstrap intervals ({cfg.bootstrap} resamples, paired differences)", timings, "bootstrap_s"):
        add_intervals(results, ranks, n_boot=cfg.bootstrap, seed=cfg.seed)
    add_agreement(results, {row: {name: [p.ranking[0] for p in parsed] for name, parsed in by.items()} for row, by in answers.items()})
    report = "\n\n".join(f"## {s}\n\n{markdown_table(results, s)}" for s in cfg.splits)
    ablation = "\n\n".join(
        f"## Ablation ({s}, {decoding_note(cfg)}; intervals: {cfg.bootstrap} bootstrap resamples, paired)\n\n{ablation_table(results, s)}"
        for s in cfg.splits
    )
    ladder = "\n\n".join(
        f"## From GR2 to Diffusion-GR2 ({s}: each rung paired against gr2 and the incoming order, {decoding_note(cfg)})\n\n{table}"
        for s in cfg.splits if (table := diffusion_ladder(results, s))
    )
    sections = [ablation, ladder, spec_report(results, cfg.splits), report]
    write_text_atomic("# Re-ranking evaluation\n\n" + "\n\n".join(part for part in sections if part) + "\n", root / REPORT)
    tracker.log_artifact(root / REPORT)
    write_rankings(answers, lists, root / RANKINGS)
    if models:
        with timed(log, "decode-speed benchmark", timings, "bench_s"):
            rows = run_bench(cfg, root, log, models, results)
        log.info("decode speed:\n%s", speed_table(rows))
        tracker.log_artifact(root / SPEED_REPORT)
        tracker.log_metrics({speed_metric_key(r): r["speedup"] for r in rows})
    tracker.log_metrics(timings)
    write_html_report(root, results, log, tracker)
    return results


def write_rankings(answers: dict[str, dict[str, Sequence[ParsedResponse]]], lists: dict[str, pl.DataFrame], path: Path) -> None:
    """`path` (parquet, written atomically): one line per LM row, split and example, in the split's order of
    re-ranking examples: `row`, `split`, `example` (0-based index), `user_id` (null for lists without one), `ranking` (the parsed answer,
    the incoming order where it was invalid, as served) and `valid` (a valid permutation as written)."""
    frames = [
        pl.DataFrame(
            {
                "row": [row] * len(parsed),
                "split": [split] * len(parsed),
                "example": list(range(len(parsed))),
                "user_id": lists[split]["user_id"].head(len(parsed)).to_list() if "user_id" in lists[split].columns else [None] * len(parsed),
                "ranking": [[int(i) for i in p.ranking] for p in parsed],
                "valid": [bool(p.valid_permutation) for p in parsed],
            },
            schema=RANKINGS_SCHEMA,
        )
        for row, by_split in answers.items()
        for split, parsed in by_split.items()
    ]
    table = pl.concat(frames) if frames else pl.DataFrame(schema=RANKINGS_SCHEMA)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        table.write_parquet(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_html_report(root: Path, results: dict[str, dict[str, dict[str, Any]]], log: logging.Logger, tracker: StageTracker) -> None:
    """`reports/index.html` (tasks/report.py) from these results and the metrics on disk, logged to the run.

    The stage's numbers are already written when this runs, so a plotting or
    MLflow problem is a warning, never a failed stage (`gr2 report` redraws it).
    metrics/evaluate.json is written only after `run` returns: `results` stands in for it.
    """
    try:
        from tasks.report import load_inputs, write_report

        path = write_report(load_inputs(root, evaluate=results, with_mlflow=tracker.enabled, with_registry=tracker.enabled))
        tracker.log_artifact(path)
        log.info("report written: %s", path)
    except Exception as exc:
        log.warning("reports/index.html not written (%s: %s); `gr2 report` draws it from the metrics on disk", type(exc).__name__, exc)


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS, distributed=True)


if __name__ == "__main__":
    main()
