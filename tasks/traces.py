"""Stage `traces`: the stronger teacher writes reasoning traces for the training re-ranking examples.

The teacher (`traces.teacher`) scores candidates from co-purchase statistics,
shared semantic-id prefixes and attributes and the pre-ranker's scores: "ltr"
(default, gr2model.teachers.ltr_teacher.LTRTeacher) with a LightGBM lambdarank model
fitted on the training lists and early-stopped on validation, "linear" with the
expert's (gr2model.teachers.teacher.ExpertTeacher) conditional logit. Test accuracy is
reported, never used for fitting. Rejection
sampling (default) keeps a sampled ranking only when it puts the target first;
targeted mode explains a ranking with the target moved first; distill mode
explains the teacher's own ranking (no target), so the student imitates the
teacher's choice rather than a noisy label. The prompt format
chosen here is written to `data/traces/format.json` and used by every later stage.

    python -m tasks.traces
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import polars as pl
from pydantic import Field, field_validator, model_validator

from gr2model.bounds import FieldRangeError
from gr2model.data.candidates import rerank_metrics, write_parquet_atomic
from gr2model.data.dataset import Dataset, load_prepared
from gr2model.teachers.ltr_teacher import LTR_FEATURE_NAMES, LTRConfig, LTRTeacher, evidence_values
from gr2model.task.rerank_format import MAX_EVIDENCE, FormatConfig, ItemText, evidence_levels, fit_evidence_bins
from gr2model.teachers.teacher import ExpertTeacher, ReasoningStyle, TeacherConfig, TraceMode, generate_traces, teacher_accuracy
from tasks.common import Cap, Count, Positive, Seed, StageConfig, atomic_dir, stage_main, timed
from tasks.tracking import StageTracker

STAGE = "traces"
PREPARED = Path("data/prepared")
CANDIDATES = Path("data/candidates")
OUT_DIR = Path("data/traces")
EVIDENCE = "evidence"  # data/traces/evidence/<split>.parquet: user_id, position, evidence (K x F levels)
SPLITS = ("train", "valid", "test")
METRICS = Path("metrics/traces.json")


class TracesConfig(StageConfig):
    # ltr: LightGBM lambdarank on rich features (gr2model.teachers.ltr_teacher); linear: the expert's
    # conditional logit on its 10 features. Both explain with the expert's evidence.
    teacher: Literal["ltr", "linear"] = "ltr"
    ltr: LTRConfig = LTRConfig()
    mode: TraceMode = "rejection"
    samples: Count = 8
    temperature: Positive = 1.0
    target_tokens: Count = 130
    seed: Seed = 0
    # Leading answer positions that follow the kept ranking; the rest in the incoming order (0: all).
    ranked_positions: Cap = 0
    # Step 2 of the explanation: evidence (the teacher's sentences about its top candidates) |
    # scan (every candidate's evidence and the best so far; needs distill, answer index, evidence).
    reasoning: ReasoningStyle = "evidence"
    # The prompt format of the whole re-ranker (shared by sft ... evaluate through format.json).
    history_len: Cap = 10  # 0 writes no history
    with_attributes: bool = True
    max_attributes: Cap = 3  # 0 writes none
    answer: Literal["sid", "index"] = "sid"  # recommendations as semantic ids or as incoming positions
    # Rank-first fast mode: the recommendations before the explanation (the ranking then
    # cannot depend on the reasoning). False: the reasoning first, citing candidates by position.
    answer_first: bool = False
    max_examples: Cap = 0  # 0 = every training re-ranking example; >0 keeps the first N (smoke runs)
    # distill only: also trace this many training lists whose target is not among the
    # candidates (-1: all of them, 0: none), drawn with `seed`. The teacher's choice needs
    # no target, so they are more examples of the function the student imitates.
    unlabelled_lists: int = Field(0, ge=-1)
    # Also fit the LTR ranker on the prompt-visible features only (ltr_teacher.PROMPT_FEATURE_NAMES)
    # and report its accuracy: the ceiling of a student that reads only the prompt.
    prompt_ceiling: bool = True
    # Per-candidate evidence written into every prompt (names of ltr_teacher.LTR_FEATURE_NAMES,
    # at most 8): each becomes one token <ev{f}_{level}>, its level among 8 quantile bins
    # fitted on the training lists. Empty: the prompt shows only SIDs, attributes and positions.
    evidence: list[str] = []

    @field_validator("evidence")
    @classmethod
    def _known_evidence(cls, names: list[str]) -> list[str]:
        if unknown := [n for n in names if n not in LTR_FEATURE_NAMES]:
            raise ValueError(f"unknown features {unknown}; known: {list(LTR_FEATURE_NAMES)}")
        if len(names) > MAX_EVIDENCE or len(set(names)) != len(names):
            raise ValueError(f"at most {MAX_EVIDENCE} distinct features, got {names}")
        return names

    @model_validator(mode="after")
    def _scan_needs_its_inputs(self) -> TracesConfig:
        if self.reasoning == "scan":
            if self.mode != "distill":
                raise FieldRangeError("reasoning", f"'scan' needs mode 'distill' (mode is {self.mode!r}): its pick is the teacher's own argmax")
            if self.answer != "index" or not self.evidence:
                raise FieldRangeError("reasoning", f"'scan' needs answer 'index' and evidence in the prompt (answer {self.answer!r}, evidence {self.evidence})")
        return self

    @model_validator(mode="after")
    def _unlabelled_need_distill(self) -> TracesConfig:
        if self.unlabelled_lists and self.mode != "distill":
            raise FieldRangeError("unlabelled_lists", f"{self.unlabelled_lists} needs mode 'distill' (mode is {self.mode!r}): only the teacher's own choice needs no target")
        return self


CONFIG = TracesConfig


def user_folds_from_lists(split: pl.DataFrame, train_lists: pl.DataFrame) -> np.ndarray:
    """(n_users,) the fold each user's training lists were cross-fitted in, aligned with `split`.

    The teacher must leave out the same fold's interactions as the pre-ranker
    that produced a list, or its co-purchase counts contain the list's target.
    Users with no training list get -1 (their interactions count in every fold).
    """
    folds = train_lists.select("user_id", "fold").unique("user_id")
    aligned = split.select("user_id").join(folds, on="user_id", how="left", maintain_order="left")
    return aligned["fold"].fill_null(-1).to_numpy()


def teacher_ltr_config(cfg: TracesConfig) -> LTRConfig:
    """The LTR teacher's config: with `ltr.features: prompt` the teacher reads what the prompt
    shows, and the prompt shows the evidence too (at full precision, not in the prompt's levels).

    A teacher that reads nothing the student cannot see gives the student picks that are a
    function of its prompt, at the cost of the hidden features' gain (`prompt_evidence_ceiling`
    in the stage metrics is that teacher's accuracy under any `features`)."""
    if cfg.ltr.features != "prompt":
        return cfg.ltr
    return replace(cfg.ltr, prompt_evidence=tuple(cfg.evidence))


def fit_teacher(
    cfg: TracesConfig, ds: Dataset, split: pl.DataFrame, train: pl.DataFrame, valid: pl.DataFrame
) -> tuple[ExpertTeacher | LTRTeacher, ExpertTeacher, dict[str, Any] | None]:
    """(the teacher, the expert whose sentences explain, the LTR fit's info or None), fitted on
    the cross-fitted training lists (the LTR teacher early-stopped on `valid`)."""
    expert = ExpertTeacher(
        ds.items, split["train"].to_list(), ds.num_items, target_tokens=cfg.target_tokens, folds=user_folds_from_lists(split, train)
    )
    if cfg.teacher != "ltr":
        expert.fit_weights(train)
        return expert, expert, None
    # Fits the expert's linear weights too (explanations use them); early stopping on validation.
    teacher = LTRTeacher(expert, teacher_ltr_config(cfg))
    return teacher, expert, teacher.fit(train, valid)


def run(cfg: TracesConfig, root: Path, log: logging.Logger, tracker: StageTracker) -> dict[str, Any]:
    """Fit the teacher, write the traces and the format; returns the stage metrics."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    ds, split = load_prepared(root / PREPARED)
    train = pl.read_parquet(root / CANDIDATES / "train.parquet")
    valid = pl.read_parquet(root / CANDIDATES / "valid.parquet")
    fmt = FormatConfig(
        history_len=cfg.history_len, with_attributes=cfg.with_attributes, max_attributes=cfg.max_attributes, answer=cfg.answer,
        answer_first=cfg.answer_first,
    )
    items = ItemText(ds.items)

    test = pl.read_parquet(root / CANDIDATES / "test.parquet")  # report only: never used for fitting
    with timed(log, f"build the {cfg.teacher} teacher and fit it on the training lists", timings, "fit_s"):
        teacher, expert, ltr_info = fit_teacher(cfg, ds, split, train, valid)
        weights = expert.weights
    log.info("linear teacher weights: %s", {k: round(v, 3) for k, v in weights.items()})
    with timed(log, "teacher accuracy on validation and test (no target knowledge)", timings, "accuracy_s"):
        accuracy = {"teacher": teacher_accuracy(teacher, valid), "prerank": rerank_metrics(valid)}
        test_accuracy = {"teacher": teacher_accuracy(teacher, test), "prerank": rerank_metrics(test)}
    log.info(
        "R@1 teacher vs pre-rank: valid %.4f vs %.4f, test %.4f vs %.4f",
        accuracy["teacher"]["recall@1"], accuracy["prerank"]["recall@1"],
        test_accuracy["teacher"]["recall@1"], test_accuracy["prerank"]["recall@1"],
    )  # fmt: skip
    if cfg.prompt_ceiling:
        # What a student that reads only the prompt could gain: without evidence, and
        # with the evidence the prompt writes (when traces.evidence names any).
        ceilings = {"prompt_ceiling": ()} | ({"prompt_evidence_ceiling": tuple(cfg.evidence)} if cfg.evidence else {})
        for key, names in ceilings.items():
            with timed(log, f"{key}: the LTR ranker on the prompt-visible features{' + evidence' if names else ''}", timings, f"{key}_s"):
                ceiling_cfg = replace(cfg.ltr, features="prompt", prompt_evidence=names)
                if isinstance(teacher, LTRTeacher) and teacher.cfg == ceiling_cfg:  # ltr.features: prompt, the teacher is this ranker
                    accuracy[key], test_accuracy[key] = accuracy["teacher"], test_accuracy["teacher"]
                else:
                    ceiling = LTRTeacher(expert, ceiling_cfg)
                    ceiling.fit(train, valid, fit_linear=False)
                    accuracy[key] = teacher_accuracy(ceiling, valid)
                    test_accuracy[key] = teacher_accuracy(ceiling, test)
            log.info(
                "R@1 %s vs pre-rank: valid %.4f vs %.4f, test %.4f vs %.4f", key,
                accuracy[key]["recall@1"], accuracy["prerank"]["recall@1"],
                test_accuracy[key]["recall@1"], test_accuracy["prerank"]["recall@1"],
            )  # fmt: skip
    evidence: dict[str, pl.DataFrame] = {}
    if cfg.evidence:
        with timed(log, f"evidence {cfg.evidence} of every list, levels fitted on the training lists", timings, "evidence_s"):
            lists = {"train": train, "valid": valid, "test": test}
            values = {name: evidence_values(expert, df, cfg.evidence, cfg.ltr, desc=f"evidence ({name})") for name, df in lists.items()}
            fmt = replace(fmt, evidence=tuple(cfg.evidence), evidence_bins=fit_evidence_bins(values["train"]))
            for name, df in lists.items():
                levels = [evidence_levels(v, fmt.evidence_bins).tolist() for v in values[name]]
                evidence[name] = df.select("user_id", "position").with_columns(
                    pl.Series(EVIDENCE, levels, dtype=pl.List(pl.List(pl.Int8)))
                )
        log.info("evidence levels: %s", dict(zip(fmt.evidence, fmt.evidence_bins)))
        train = train.join(evidence["train"], on=["user_id", "position"], how="left", maintain_order="left")

    examples = train.filter(pl.col("target_rank") >= 0)
    if cfg.max_examples:
        examples = examples.head(cfg.max_examples)
    if cfg.unlabelled_lists:
        examples = pl.concat([examples, unlabelled_sample(train, cfg.unlabelled_lists, cfg.seed)])
    tcfg = TeacherConfig(
        mode=cfg.mode, samples=cfg.samples, temperature=cfg.temperature, target_tokens=cfg.target_tokens, seed=cfg.seed,
        ranked_positions=cfg.ranked_positions, reasoning=cfg.reasoning,
    )
    with timed(log, f"{cfg.mode} traces for {examples.height} training lists", timings, "generate_s"):
        traces, stats = generate_traces(teacher, examples, items, fmt, tcfg, unlabelled=cfg.unlabelled_lists != 0)

    with atomic_dir(root / OUT_DIR) as out:
        write_parquet_atomic(traces, out / "train.parquet")
        (out / "format.json").write_text(json.dumps(asdict(fmt), indent=2))
        for name, table in evidence.items():
            (out / EVIDENCE).mkdir(exist_ok=True)
            write_parquet_atomic(table, out / EVIDENCE / f"{name}.parquet")
        teacher_info: dict[str, Any] = {"teacher": cfg.teacher, "weights": expert.weights, "evidence_weights": expert.evidence_weights, "config": asdict(tcfg)}
        if isinstance(teacher, LTRTeacher):
            (out / "teacher_ltr.txt").write_text(teacher.model_text())
            teacher_info["ltr"] = {
                "config": asdict(teacher.cfg),
                "feature_names": list(teacher.feature_names),
                "model": "teacher_ltr.txt",
                # Timings go to the metrics: the data folder must rebuild bit for bit.
                **{k: v for k, v in (ltr_info or {}).items() if not k.endswith("_s")},
            }
        (out / "teacher.json").write_text(json.dumps(teacher_info, indent=2))
    tracker.log_metrics({f"teacher_weight.{k}": v for k, v in weights.items()})
    return {
        "mode": cfg.mode,
        **stats,
        "kept": int(traces["kept"].sum()),
        "valid_accuracy": accuracy,
        "test_accuracy": test_accuracy,
        **{f"ltr_{k}": v for k, v in (ltr_info or {}).items() if k.endswith("_s")},
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }


def unlabelled_sample(train: pl.DataFrame, n: int, seed: int) -> pl.DataFrame:
    """n training lists whose target is not among the candidates (all of them for n = -1),
    drawn with `seed` and kept in (user_id, position) order."""
    pool = train.filter(pl.col("target_rank") < 0)
    take = pool.height if n < 0 else min(n, pool.height)
    return pool.sample(take, seed=seed).sort("user_id", "position")


def load_format(root: Path) -> FormatConfig:
    """The prompt format the traces were written in (every later stage uses it)."""
    return FormatConfig(**json.loads((root / OUT_DIR / "format.json").read_text()))


def load_lists(root: Path, split: str) -> pl.DataFrame:
    """The candidate lists of `split` (data/candidates/<split>.parquet) with their
    evidence levels (column `evidence`) when the traces stage wrote them."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    lists = pl.read_parquet(root / CANDIDATES / f"{split}.parquet")
    path = root / OUT_DIR / EVIDENCE / f"{split}.parquet"
    if not path.exists():
        return lists
    ev = pl.read_parquet(path)
    if ev.height != lists.height:
        raise ValueError(f"{path}: {ev.height} rows for the {lists.height} lists of {CANDIDATES / split}.parquet; rerun traces")
    return lists.join(ev, on=["user_id", "position"], how="left", maintain_order="left", validate="1:1")


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS)


if __name__ == "__main__":
    main()
