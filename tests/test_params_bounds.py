"""Every numeric param carries its valid range, so a bad value fails at load, naming the dotted field,
instead of deep inside a stage.

BOUNDS below is the spec: the valid range of every numeric field of every stage's
config, written out once. `test_bounds_cover_every_numeric_field` walks the config
classes (pydantic models and gr2model dataclasses) and the default params.yaml,
so a new numeric knob without a range here fails the suite. The properties then
draw values outside each range (below, above, NaN, infinities, fractional ints)
and check that `load_stage_config` raises ParamsError naming the file and field,
and that values at the edges of each range still validate.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tasks.common import STAGES, ParamsError, load_stage_config

ROOT = Path(__file__).resolve().parents[1]
PARAMS: dict[str, Any] = yaml.safe_load((ROOT / "params.yaml").read_text())


@dataclasses.dataclass(frozen=True)
class B:
    """A field's valid range: `kind` int or float, optional bounds, None allowed, a list of such numbers."""

    kind: type
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    optional: bool = False
    listed: bool = False


def I(**kw: Any) -> B:  # noqa: E743 - short names keep the table readable
    return B(int, **kw)


def F(**kw: Any) -> B:
    return B(float, **kw)


COUNT, CAP, SEED = I(ge=1), I(ge=0), I(ge=0)
POS, NONNEG, UNIT, ANY_F, ANY_I = F(gt=0), F(ge=0), F(ge=0, le=1), F(), I()

SFT = {
    "epochs": COUNT, "batch_size": COUNT, "lr": POS, "weight_decay": NONNEG, "warmup_steps": CAP,
    "reasoning_weight": NONNEG, "answer_weight": NONNEG, "citation_weight": F(ge=0, optional=True),
    "decision_weight": NONNEG, "decision_temperature": POS,
    "max_length": I(ge=2), "seed": SEED,
    "grad_clip": ANY_F,  # <= 0 disables clipping
}
DAPO = {
    "group_size": I(ge=2), "prompts_per_step": COUNT, "steps": COUNT, "inner_epochs": COUNT, "minibatch_size": COUNT,
    "lr": POS, "clip_low": F(ge=0, lt=1), "clip_high": NONNEG, "temperature": POS, "max_new_tokens": COUNT,
    "max_resample_rounds": CAP, "seed": SEED, "grad_clip": ANY_F, "weight_decay": NONNEG,
}
BOUNDS: dict[str, dict[str, B]] = {
    "prepare": {"sid_length": I(ge=4, le=4), "kcore": COUNT, "min_seq_len": I(ge=3), "max_users": CAP},
    "prepare.sid_builder": {"dim": COUNT, "levels": I(ge=3, le=3), "codebook_size": I(ge=2), "seed": SEED},
    "retrieve": {
        "seed": SEED, "k": I(ge=2, le=50), "ensemble_grid": F(ge=0, listed=True), "crossfit_folds": I(ge=2),
        "min_history": COUNT, "train_positions_per_user": CAP, "eval_chunk_size": COUNT,
    },
    "retrieve.sasrec": {"max_len": COUNT, "hidden": COUNT, "heads": COUNT, "layers": COUNT, "dropout": F(ge=0, lt=1)},
    "retrieve.train": {
        "epochs": COUNT, "batch_size": COUNT, "lr": POS, "weight_decay": NONNEG, "patience": COUNT,
        "num_negatives": CAP, "eval_every": COUNT, "max_valid_users": CAP,
    },
    "retrieve.transition": {
        "last_n": COUNT, "decay": F(gt=0, le=1), "window": COUNT, "window_decay": F(gt=0, le=1), "smoothing": POS,
    },
    "traces": {
        "samples": COUNT, "temperature": POS, "target_tokens": COUNT, "seed": SEED, "history_len": CAP,
        "max_attributes": CAP, "max_examples": CAP, "unlabelled_lists": I(ge=-1), "ranked_positions": CAP,
    },
    "traces.ltr": {
        "num_leaves": I(ge=2, le=1024), "learning_rate": F(gt=0, le=1), "n_estimators": I(ge=1, le=2000),
        "min_child_samples": COUNT, "reg_lambda": NONNEG, "subsample": F(gt=0, le=1),
        "colsample_bytree": F(gt=0, le=1), "early_stopping_rounds": COUNT, "long_decay": F(gt=0, le=1),
        "max_history": COUNT, "seed": I(ge=0, le=2**31 - 1),
    },
    "midtrain": {"seed": SEED},
    "midtrain.model": {
        "hidden_size": COUNT, "num_layers": COUNT, "num_heads": COUNT, "num_kv_heads": COUNT,
        "intermediate_size": COUNT, "max_position_embeddings": COUNT, "rope_theta": POS,
    },
    "midtrain.train": SFT,
    "midtrain.tasks": {
        "max_items": I(ge=2), "max_attributes": CAP, "persona_history": COUNT, "persona_min_count": COUNT,
        "max_traces": CAP, "max_examples_per_task": CAP, "seed": SEED,
    },
    "midtrain.eval": {"eval_users": CAP, "beam_width": I(ge=10), "batch_size": COUNT, "seed": SEED},
    "sft": {"seed": SEED, "valid_fraction": F(ge=0, lt=1), "max_examples": CAP},
    "sft.train": SFT,
    "ar_rl": {"seed": SEED, "format_bonus": NONNEG, "invalid_penalty": F(le=0), "max_prompts": CAP},
    "ar_rl.train": DAPO,
    "trajectories": {"batch_size": COUNT, "max_new_tokens": COUNT, "max_examples": CAP},
    "cft": {"seed": SEED, "valid_fraction": F(ge=0, lt=1), "max_examples": CAP},
    "cft.train": {
        **{k: b for k, b in SFT.items() if k not in ("citation_weight", "decision_weight", "decision_temperature")}, "pad_weight": NONNEG, "block_size": COUNT, "t_min": UNIT,
        "valid_every": CAP, "kd_weight": NONNEG, "suffix_prob": UNIT,
    },
    "opd": {"seed": SEED, "max_prompts": CAP},
    "opd.train": {
        "rollouts_per_prompt": COUNT, "prompts_per_step": COUNT, "steps": COUNT, "inner_epochs": COUNT,
        "minibatch_size": COUNT, "lr": POS, "weight_decay": NONNEG, "teacher_top_k": CAP, "threshold": UNIT,
        "sub_block_size": I(ge=1, optional=True), "temperature": NONNEG,  # 0: greedy rollouts
        "max_new_tokens": COUNT, "max_copies": COUNT, "micro_batch_columns": ANY_I,  # <= 0: all at once
        "seed": SEED, "grad_clip": ANY_F, "cft_weight": NONNEG, "cft_batch_size": COUNT,
    },
    "rl": {"seed": SEED, "max_prompts": CAP, "format_bonus": NONNEG, "invalid_penalty": F(le=0)},
    "rl.train": {
        **DAPO, "threshold": UNIT, "sub_block_size": I(ge=1, optional=True), "max_copies": COUNT,
        "micro_batch_columns": ANY_I,
    },
    "evaluate": {
        "batch_size": COUNT, "max_new_tokens": COUNT, "max_examples": CAP, "diffusion_max_examples": CAP,
        "seed": SEED, "bootstrap": COUNT, "tau": UNIT, "sub_block_size": I(ge=1, optional=True),
        "naive_block_size": COUNT, "explanation_tau": F(ge=0, le=1, optional=True),
        "explanation_sub_block_size": I(ge=1, optional=True),
    },
    "evaluate.bench": {
        "taus": F(ge=0, le=1, listed=True), "batch_sizes": I(ge=1, listed=True), "examples": COUNT,
        "explanation_taus": F(ge=0, le=1, listed=True), "explanation_sub_block_size": I(ge=1, optional=True),
        "sub_block_sizes": I(ge=1, listed=True), "sub_block_cache_sizes": I(ge=1, listed=True), "spec_draft_len": COUNT, "spec_steps": COUNT,
        "repeats": COUNT,
    },
}
FIELDS: dict[str, B] = {f"{owner}.{name}": b for owner, fields in BOUNDS.items() for name, b in fields.items()}
# Fields whose lower edge alone breaks a cross-field rule with the defaults (heads must divide the width).
CROSS_FIELD = {"retrieve.sasrec.hidden", "midtrain.model.hidden_size", "midtrain.model.num_heads"}


# ------------------------------------------------------------------ the schema walk


def _numeric(tp: Any) -> tuple[type, bool] | None:
    """(int or float, is a list) when `tp` is a number, an optional one or a list of them; else None."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _numeric(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _numeric(args[0]) if len(args) == 1 else None
    if origin is list:
        inner = _numeric(typing.get_args(tp)[0])
        return (inner[0], True) if inner else None
    if tp in (int, float):
        return tp, False
    return None


def _nested(tp: Any) -> type | None:
    """The config class of a nested section (a pydantic model or a dataclass), else None."""
    return tp if isinstance(tp, type) and (issubclass(tp, BaseModel) or dataclasses.is_dataclass(tp)) else None


def schema_numeric_fields(cls: type, prefix: str) -> dict[str, tuple[type, bool]]:
    """Every numeric field under config class `cls`, by dotted path."""
    if issubclass(cls, BaseModel):
        hints = {name: f.annotation for name, f in cls.model_fields.items()}
    else:
        hints = typing.get_type_hints(cls, include_extras=True)
        hints = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    out: dict[str, tuple[type, bool]] = {}
    for name, tp in hints.items():
        path = f"{prefix}.{name}"
        if (sub := _nested(tp)) is not None:
            out.update(schema_numeric_fields(sub, path))
        elif (num := _numeric(tp)) is not None:
            out[path] = num
    return out


def params_numeric_leaves(d: dict[str, Any], prefix: str) -> set[str]:
    """Dotted paths of the numbers (and lists of numbers) in a params section."""
    out: set[str] = set()
    for k, v in d.items():
        path = f"{prefix}.{k}"
        if isinstance(v, dict):
            out |= params_numeric_leaves(v, path)
        elif isinstance(v, list) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            out.add(path)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.add(path)
    return out


def config_of(stage: str) -> type[BaseModel]:
    return importlib.import_module(f"tasks.{stage}").CONFIG


def test_bounds_cover_every_numeric_field() -> None:
    schema = {path: num for stage in STAGES for path, num in schema_numeric_fields(config_of(stage), stage).items()}
    assert sorted(schema) == sorted(FIELDS), "BOUNDS must list exactly the numeric fields of the stage configs"
    for path, (kind, listed) in schema.items():
        assert (FIELDS[path].kind, FIELDS[path].listed) == (kind, listed), path
    in_yaml = set().union(*(params_numeric_leaves(PARAMS[s], s) for s in STAGES))
    assert in_yaml <= set(FIELDS), f"numeric params without a range: {sorted(in_yaml - set(FIELDS))}"


# ------------------------------------------------------------------ validation helpers


def with_value(stage: str, dotted: str, value: Any) -> dict[str, Any]:
    """The default `stage` section with the field at `dotted` (stage.a.b) set to `value`."""
    section = copy.deepcopy(PARAMS[stage])
    node = section
    *parents, leaf = dotted.split(".")[1:]
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return section


def load_section(stage: str, section: dict[str, Any]) -> BaseModel:
    """`load_stage_config` on a params file holding only this section (faster than the whole file)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "params.yaml"
        path.write_text(yaml.safe_dump({stage: section}))
        try:
            return load_stage_config(stage, config_of(stage), path)
        except ParamsError as exc:
            # The file's name is in the message; replace the random folder for stable assertions.
            raise ParamsError(str(exc).replace(str(path), "params.yaml")) from exc


def out_of_range(b: B) -> st.SearchStrategy[Any]:
    """Values outside `b`'s range (and, for ints, non-integral numbers)."""
    options: list[st.SearchStrategy[Any]] = []
    if b.kind is int:
        options.append(st.floats(-1e6, 1e6).filter(lambda x: x != math.floor(x)))
        low = b.ge - 1 if b.ge is not None else b.gt
        high = b.le + 1 if b.le is not None else b.lt
        if low is not None:
            options.append(st.integers(max_value=int(low), min_value=int(low) - 10**9))
        if high is not None:
            options.append(st.integers(min_value=int(high), max_value=int(high) + 10**9))
    else:
        options.append(st.sampled_from([math.nan, math.inf, -math.inf]))
        for bound, side, inclusive in ((b.ge, "low", True), (b.gt, "low", False), (b.le, "high", True), (b.lt, "high", False)):
            if bound is None:
                continue
            if side == "low":
                options.append(st.floats(min_value=bound - 1e6, max_value=bound, exclude_max=inclusive))
            else:
                options.append(st.floats(min_value=bound, max_value=bound + 1e6, exclude_min=inclusive))
    return st.one_of(options)


def edges(b: B) -> list[Any]:
    """Values at (or, for open ends, just inside) each end of `b`'s range, all valid."""
    step = 1 if b.kind is int else 1e-6
    lows = [b.ge] if b.ge is not None else [b.gt + step] if b.gt is not None else []
    highs = [b.le] if b.le is not None else [b.lt - step] if b.lt is not None else []
    values = [b.kind(v) for v in lows + highs]
    if not values:  # unbounded: any finite value, negative included
        values = [b.kind(-5), b.kind(0), b.kind(5)]
    return values


def as_param(b: B, value: Any) -> Any:
    return [value] if b.listed else value


# ------------------------------------------------------------------ the properties


@pytest.mark.parametrize("dotted", sorted(FIELDS))
# derandomize: the same draws on every run (a failure reproduces); no example database on disk.
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, database=None)
@given(data=st.data())
def test_out_of_range_value_fails_naming_the_field(dotted: str, data: st.DataObject) -> None:
    stage, b = dotted.split(".")[0], FIELDS[dotted]
    value = data.draw(out_of_range(b), label=dotted)
    with pytest.raises(ParamsError) as err:
        load_section(stage, with_value(stage, dotted, as_param(b, value)))
    # `params.yaml: evaluate.bench.taus.0: ...`: the file, then the field (a list's index after it).
    assert re.search(rf"^params\.yaml: {re.escape(dotted)}(\.\d+)?: ", str(err.value), re.M), str(err.value)


@pytest.mark.parametrize("dotted", sorted(set(FIELDS) - CROSS_FIELD))
def test_edges_of_each_range_validate(dotted: str) -> None:
    """The bounds are not stricter than the range: both ends (0 where 0 means all, etc.) pass."""
    stage, b = dotted.split(".")[0], FIELDS[dotted]
    for value in edges(b):
        load_section(stage, with_value(stage, dotted, as_param(b, value)))


def test_cross_field_rules_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match=r"params\.yaml: midtrain\.model\.num_heads: .*does not divide hidden_size"):
        load_section("midtrain", with_value("midtrain", "midtrain.model.num_heads", 3))
    with pytest.raises(ParamsError, match=r"params\.yaml: midtrain\.model\.num_kv_heads: "):
        load_section("midtrain", with_value("midtrain", "midtrain.model.num_kv_heads", 3))
    with pytest.raises(ParamsError, match=r"params\.yaml: retrieve\.sasrec\.heads: "):
        load_section("retrieve", with_value("retrieve", "retrieve.sasrec.heads", 3))
    zero = with_value("sft", "sft.train.answer_weight", 0.0)
    zero["train"]["reasoning_weight"] = 0.0
    with pytest.raises(ParamsError, match=r"params\.yaml: sft\.train\.answer_weight: "):
        load_section("sft", zero)
    rejection = with_value("traces", "traces.unlabelled_lists", 100)
    rejection["mode"] = "rejection"
    rejection["reasoning"] = "evidence"  # the scan needs distill too; this checks the unlabelled lists' rule
    with pytest.raises(ParamsError, match=r"params\.yaml: traces\.unlabelled_lists: .*100 needs mode 'distill'"):
        load_section("traces", rejection)
    scan = with_value("traces", "traces.reasoning", "scan")
    load_section("traces", scan)  # the default profile's format has what the scan needs
    scan["evidence"] = []
    with pytest.raises(ParamsError, match=r"params\.yaml: traces\.reasoning: .*'scan' needs answer 'index' and evidence"):
        load_section("traces", scan)
    scan = with_value("traces", "traces.reasoning", "scan")
    scan["mode"] = "targeted"
    with pytest.raises(ParamsError, match=r"params\.yaml: traces\.reasoning: .*'scan' needs mode 'distill'"):
        load_section("traces", scan)
    # A pretrained model's size comes from its folder: the from-scratch sizes are not checked then.
    pretrained = with_value("midtrain", "midtrain.model.num_heads", 3)
    pretrained["model"]["pretrained_path"] = str(ROOT / "no/such/folder")
    with pytest.raises(ParamsError, match=r"params\.yaml: midtrain\.model\.pretrained_path: .*no/such/folder' does not exist"):
        load_section("midtrain", pretrained)
    pretrained["model"]["pretrained_path"] = str(ROOT / "tests")  # a folder, but no save_pretrained one
    with pytest.raises(ParamsError, match=r"midtrain\.model\.pretrained_path: .* has no config\.json"):
        load_section("midtrain", pretrained)
    (tmp_path / "config.json").write_text("{}")
    pretrained["model"]["pretrained_path"] = str(tmp_path)
    load_section("midtrain", pretrained)


def test_the_gpu_profile_validates_once_its_base_model_is_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """profiles/gpu.yaml names a local Qwen3 folder relative to the project root; with one there,
    every stage's section validates (without it, midtrain's error names the folder)."""
    from flows.workspace import profile_params

    params = profile_params(ROOT, "gpu")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ParamsError, match="midtrain.model.pretrained_path: .* does not exist"):
        load_section("midtrain", params["midtrain"])
    folder = tmp_path / params["midtrain"]["model"]["pretrained_path"]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    for stage in STAGES:
        load_section(stage, params[stage])


@pytest.mark.parametrize("profile", [None, "smoke"])
@pytest.mark.parametrize("stage", STAGES)
def test_default_and_profile_params_validate(stage: str, profile: str | None) -> None:
    from flows.workspace import profile_params

    load_section(stage, profile_params(ROOT, profile)[stage])


# ------------------------------------------------------------------ before any work, before MLflow


def _first_bad(stage: str) -> tuple[str, Any]:
    """A field of `stage` with a lower bound, and a value below it."""
    dotted = next(p for p in sorted(FIELDS) if p.startswith(f"{stage}.") and FIELDS[p].ge is not None and not FIELDS[p].listed)
    return dotted, FIELDS[dotted].kind(FIELDS[dotted].ge - 1)


@pytest.mark.parametrize("stage", STAGES)
def test_bad_param_exits_2_before_the_mlflow_run(
    stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import tasks.tracking

    opened: list[str] = []

    def no_run(name: str, params: Any) -> Any:
        opened.append(name)
        raise AssertionError("an MLflow run was opened for a bad params file")

    monkeypatch.setattr(tasks.tracking, "stage_run", no_run)
    dotted, value = _first_bad(stage)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({stage: with_value(stage, dotted, value)}))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"tasks.{stage}").main()
    assert exit_.value.code == 2 and opened == []
    assert f"params.yaml: {dotted}" in caplog.text


@pytest.mark.integration  # a stage process with MLflow tracking on
def test_negative_lr_fails_in_the_stage_process_with_tracking_on(tmp_path: Path) -> None:
    """The case that motivated the bounds: `retrieve.train.lr: -1` once ended in a torch traceback deep in training."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"retrieve": with_value("retrieve", "retrieve.train.lr", -1)}))
    env = {k: v for k, v in os.environ.items() if k not in ("GR2_TRACKING", "MLFLOW_RUN_ID")}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", GR2_ROOT=str(tmp_path), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.retrieve"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    assert "params.yaml: retrieve.train.lr: Input should be greater than 0 (input -1)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # no mlflow.db, no mlruns, no outputs


# ------------------------------------------------------------------ resume: (not a stage)

RESUME = {"every_steps": CAP, "every_minutes": NONNEG}


def _load_resume(section: dict[str, Any]) -> Any:
    from tasks.common import load_resume_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "params.yaml"
        path.write_text(yaml.safe_dump({"resume": section}))
        try:
            return load_resume_config(path)
        except ParamsError as exc:
            raise ParamsError(str(exc).replace(str(path), "params.yaml")) from exc


def test_resume_bounds_cover_its_fields() -> None:
    from tasks.common import ResumeConfig

    schema = schema_numeric_fields(ResumeConfig, "resume")
    assert sorted(schema) == sorted(f"resume.{k}" for k in RESUME)
    assert params_numeric_leaves(PARAMS["resume"], "resume") <= set(schema)
    _load_resume(PARAMS["resume"])


@pytest.mark.parametrize("name", sorted(RESUME))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, database=None)
@given(data=st.data())
def test_resume_out_of_range_fails_naming_the_field(name: str, data: st.DataObject) -> None:
    value = data.draw(out_of_range(RESUME[name]), label=name)
    with pytest.raises(ParamsError) as err:
        _load_resume({**PARAMS["resume"], name: value})
    assert re.search(rf"^params\.yaml: resume\.{name}: ", str(err.value), re.M), str(err.value)


@pytest.mark.parametrize("name", sorted(RESUME))
def test_resume_edges_validate(name: str) -> None:
    for value in edges(RESUME[name]):
        _load_resume({**PARAMS["resume"], name: value})
