"""What the offline report and the console read: the metrics on disk, the stages' training curves, the registry.

`reports/index.html` (tasks/report_html.py draws it) is built from
`ReportInputs`: the stages' `metrics/<stage>.json`, `metrics/speed.json`, the
per-step training histories and, when asked, the model registry. Every input
may be missing (a pipeline run only up to `sft`, tracking off, an empty
registry); the report then says which section it skipped and why.

The per-step histories live in MLflow (each trainer's `on_step` callback logs
them through `StageTracker.log_step`), not in the stage metrics, which keep
first/last summaries only; a stage metrics file that does carry a `history`
list of step dicts is read first. `import mlflow` happens inside the functions
that need it, so the console can read headlines without paying for it.

`headline_metrics` names the one or two numbers that say how a stage went: the
console's end-of-stage line, `gr2 status` and the report's stage table print them.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.common import STAGES

log = logging.getLogger("tasks.report")

REPORT_HTML = Path("reports/index.html")
METRICS_DIR = Path("metrics")
SPEED_STAGE = "speed"  # metrics/speed.json: written by `evaluate`'s benchmark, not a stage of its own

# The ablation rows, in the paper's order: each adds one stage to the row before it.
ABLATION_ROWS: tuple[str, ...] = ("prerank", "teacher", "gr2-sft", "gr2", "dgr2-naive", "dgr2-cft", "dgr2-opd", "dgr2")
SPEC_PREFIX = "spec-"  # `spec-<drafter>` rows (tasks/evaluate.py)

# Parity with AR in the speed-accuracy plot: the promotion gates' own bar (params.yaml `promote:`),
# so "speed-up at parity" means a setting that would pass them on accuracy and validity.
PARITY_R1_TOLERANCE = 0.005
PARITY_MIN_VALID_FORMAT = 0.99

# Which per-step series make each stage's training curves (those that exist are drawn).
# `signal_share` is derived: kept_groups / sampled_groups, the share of DAPO groups whose
# rewards differed (the only groups that carry a gradient).
CURVE_KEYS: dict[str, tuple[str, ...]] = {
    "retrieve": ("sasrec.loss", "sasrec.valid_recall_at_10"),
    "midtrain": ("loss", "reasoning_loss", "answer_loss"),
    "sft": ("loss", "valid_loss", "reasoning_loss", "answer_loss"),
    "ar_rl": ("reward_mean", "loss", "signal_share", "approx_kl", "valid", "hit1"),
    "cft": ("loss", "valid_loss", "reasoning_loss", "answer_loss"),
    "opd": ("kl", "reward_mean", "tokens_per_forward", "valid", "hit1"),
    "rl": ("reward_mean", "loss", "signal_share", "approx_kl", "tokens_per_forward", "valid", "hit1"),
}
MAX_CURVE_POINTS = 500  # a 9,000-step SFT curve is thinned to this many points before drawing

Curve = list[tuple[int, float]]


@dataclass
class ReportInputs:
    """Everything the report draws; a None or empty field means its section is skipped with a note."""

    root: Path
    stage_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage -> metrics/<stage>.json
    evaluate: dict[str, Any] | None = None  # {model: {split: {metric: value}}}
    speed: dict[str, Any] | None = None  # metrics/speed.json: {"rows": [...], "device", "threads", "examples"}
    curves: dict[str, dict[str, Curve]] = field(default_factory=dict)  # stage -> series -> [(step, value)]
    curves_note: str = ""  # why there are no curves, when there are none
    registry: list[dict[str, Any]] | None = None  # one dict per registered version (`registry_rows`)
    registry_note: str = ""


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from disk; None when it is missing or unreadable (a report never fails on one input)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        if path.exists():
            log.warning("%s: unreadable (%s); its report section is skipped", path, exc)
        return None
    return data if isinstance(data, dict) else None


def read_stage_metrics(root: Path) -> dict[str, dict[str, Any]]:
    """stage -> its metrics/<stage>.json, for the stages that wrote one."""
    found = {}
    for stage in (*STAGES, SPEED_STAGE):
        data = read_json(root / METRICS_DIR / f"{stage}.json")
        if data is not None:
            found[stage] = data
    return found


def dig(d: Mapping[str, Any] | None, dotted: str) -> Any:
    """`dig({"a": {"b": 1}}, "a.b") == 1`; None when any key is missing. Keys may hold '@' but not '.'."""
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
        return None
    return float(x)


# --- the speed-accuracy trade-off -------------------------------------------------------------


def ar_reference(rows: Sequence[Mapping[str, Any]], batch_size: int) -> Mapping[str, Any] | None:
    """The AR row the speed-ups are measured against at this batch size: our loop (`ar`), else HF's."""
    at = [r for r in rows if r.get("batch_size") == batch_size]
    return next((r for r in at if r.get("decoder") == "ar"), None) or next((r for r in at if r.get("decoder") == "hf"), None)


def setting_label(row: Mapping[str, Any]) -> str:
    """A diffusion row's decoder setting in words: `tau 0.9, sub-block 8, explanation 0.5`."""
    parts = [f"tau {row.get('tau')}"]
    if row.get("sub_block_size") is not None:
        parts.append(f"sub-block {row['sub_block_size']}")
    if row.get("sub_block_cache"):
        parts.append("sub-block cache")
    if row.get("explanation_tau") is not None:
        parts.append(f"explanation {row['explanation_tau']}")
    if row.get("explanation_sub_block_size") is not None:
        parts.append(f"explanation sub-block {row['explanation_sub_block_size']}")
    if row.get("grammar"):  # a constrained bench also holds the served setting's plain twin
        parts.append("answer grammar")
    if row.get("every_example_recall@1_vs_gr2") is not None:
        parts.append("judged on every example")
    return ", ".join(parts)


def parity_point(
    rows: Sequence[Mapping[str, Any]], batch_size: int, *, tolerance: float = PARITY_R1_TOLERANCE, min_valid: float = PARITY_MIN_VALID_FORMAT
) -> Mapping[str, Any] | None:
    """The fastest diffusion row at `batch_size` that matches AR: R@1 no lower than AR's by more than
    `tolerance` and a valid-format rate of at least `min_valid`. None when no setting does.

    A row that `evaluate` also decoded on every example (its `every_example_*` fields,
    `tasks.evaluate.mark_every_example`) is judged on those: the paired R@1 difference to GR2
    and the valid-format rate over every validation and test example. The others are judged on
    the bench's own n examples only when one example (1/n of R@1) is within `tolerance`: on
    64 examples one lucky hit is 0.016, three times the tolerance, and would crown any setting."""
    ar = ar_reference(rows, batch_size)
    if ar is None or _number(ar.get("recall@1")) is None:
        return None

    def matches(r: Mapping[str, Any]) -> bool:
        if (d := _number(r.get("every_example_recall@1_vs_gr2"))) is not None:
            return d >= -tolerance and (_number(r.get("every_example_valid_format_rate")) or -1.0) >= min_valid
        n = _number(r.get("n")) or 0
        return (
            n > 0 and 1.0 / n <= tolerance
            and (_number(r.get("recall@1")) or -1.0) >= float(ar["recall@1"]) - tolerance
            and (_number(r.get("valid_format_rate")) or -1.0) >= min_valid
        )  # fmt: skip

    ok = [
        r
        for r in rows
        if r.get("batch_size") == batch_size and r.get("decoder") == "diffusion" and _number(r.get("speedup")) is not None and matches(r)
    ]
    return max(ok, key=lambda r: float(r["speedup"]), default=None)


# --- headlines --------------------------------------------------------------------------------

# label -> dotted path into metrics/<stage>.json; the first two that exist are the headline.
_HEADLINE_PATHS: dict[str, tuple[tuple[str, str], ...]] = {
    "prepare": (("users", "users"), ("items", "items")),
    "retrieve": (("R@10", "full_ranking.test.prerank.recall@10"), ("rerank R@1", "rerank.test.recall@1")),
    "traces": (("teacher R@1", "test_accuracy.teacher.recall@1"), ("traces", "n_traces")),
    "midtrain": (("loss", "final_train_loss"), ("R@10", "retrieval.test.recall@10")),
    "sft": (("loss", "final_train_loss"), ("valid loss", "valid.valid_loss")),
    "ar_rl": (("reward", "reward_mean_last"), ("valid", "valid_last")),
    "trajectories": (("valid perm", "valid_permutation_rate"), ("R@1", "recall@1")),
    "cft": (("loss", "final_train_loss"), ("valid loss", "valid.valid_loss")),
    "opd": (("KL", "kl_last"), ("tokens/forward", "tokens_per_forward_last")),
    "rl": (("reward", "reward_mean_last"), ("valid", "valid_last")),
}


def headline_metrics(stage: str, metrics: Mapping[str, Any] | None, speed: Mapping[str, Any] | None = None) -> list[tuple[str, float | str]]:
    """The one or two numbers that say how a stage went, as (label, value); [] when none is known.

    `evaluate`: GR2's valid-permutation rate and R@1 on test (the headline model
    of the AR chain) and the speed-up at parity at batch size 1 from `speed`
    ("none" when no diffusion setting matches AR).
    """
    if not metrics:
        return []
    if stage == "evaluate":
        out: list[tuple[str, float | str]] = []
        split = "test" if dig(metrics, "gr2.test") is not None else "valid"
        for label, key in (("gr2 valid perm", "valid_permutation_rate"), ("gr2 R@1", "recall@1")):
            if (v := _number(dig(metrics, f"gr2.{split}.{key}"))) is not None:
                out.append((label, v))
        rows = (speed or {}).get("rows") or []
        if rows:
            p = parity_point(rows, 1)
            out.append(("speed-up at parity", float(p["speedup"]) if p else "none"))
        return out
    out = []
    for label, path in _HEADLINE_PATHS.get(stage, ()):
        if (v := _number(dig(metrics, path))) is not None:
            out.append((label, v))
    return out[:2]


def stage_headline(root: Path, stage: str, metrics: Mapping[str, Any] | None) -> str:
    """The formatted headline of a stage from its metrics (`evaluate` also reads metrics/speed.json):
    the console's end line, `gr2 status`, the Prefect artifacts."""
    speed = read_json(root / METRICS_DIR / f"{SPEED_STAGE}.json") if stage == "evaluate" else None
    return format_headline(headline_metrics(stage, metrics, speed))


def format_headline(items: Sequence[tuple[str, float | str]]) -> str:
    """`[("R@10", 0.0928)] -> "R@10 0.0928"`; counts print as integers."""
    parts = []
    for label, value in items:
        if isinstance(value, str):
            parts.append(f"{label} {value}")
        elif float(value).is_integer() and abs(value) >= 10:
            parts.append(f"{label} {int(value):,}")
        elif label.startswith("speed"):
            parts.append(f"{label} {value:.2f}x")
        elif label.startswith("tokens/"):  # a count per forward, not a rate in [0, 1]
            parts.append(f"{label} {value:.2f}")
        else:
            parts.append(f"{label} {value:.4f}")
    return ", ".join(parts)


# --- training curves --------------------------------------------------------------------------


def thin(curve: Curve, max_points: int = MAX_CURVE_POINTS) -> Curve:
    """Every k-th point (and the last) so that at most about `max_points` remain; short curves unchanged."""
    if len(curve) <= max_points:
        return curve
    k = math.ceil(len(curve) / max_points)
    out = curve[::k]
    return out if out[-1] == curve[-1] else [*out, curve[-1]]


def _with_signal_share(series: dict[str, Curve], kept: Curve, sampled: Curve) -> None:
    total = dict(sampled)
    share = [(s, k / total[s]) for s, k in kept if total.get(s)]
    if share:
        series["signal_share"] = share


def curves_from_history(stage: str, history: Sequence[Mapping[str, Any]]) -> dict[str, Curve]:
    """Series of CURVE_KEYS from a list of step dicts (`{"step": 3, "loss": 1.2, ...}`; no step: the index)."""
    wanted = CURVE_KEYS.get(stage, ())
    raw: dict[str, Curve] = {}
    for i, h in enumerate(history):
        step = int(h.get("step", i)) if _number(h.get("step", i)) is not None else i
        for key, value in h.items():
            if (v := _number(value)) is not None and (key in wanted or key in ("kept_groups", "sampled_groups")):
                raw.setdefault(key, []).append((step, v))
    series = {k: thin(raw[k]) for k in wanted if k in raw}
    if "signal_share" in wanted and "kept_groups" in raw and "sampled_groups" in raw:
        _with_signal_share(series, raw["kept_groups"], raw["sampled_groups"])
    return {k: series[k] for k in wanted if k in series}


def mlflow_curves(root: Path, stages: Sequence[str] = tuple(CURVE_KEYS)) -> dict[str, dict[str, Curve]]:
    """stage -> series, from the step metrics of each stage's latest finished MLflow run in this workspace.

    Reads the project's store (`tasks.tracking.configure`); a stage without a
    finished run, or a store that cannot be read, gives no curves.
    """
    from mlflow import MlflowClient

    from tasks.tracking import configure, experiment_id

    configure(root)
    client = MlflowClient()
    exp = experiment_id(root)
    out: dict[str, dict[str, Curve]] = {}
    for stage in stages:
        runs = client.search_runs(
            [exp], filter_string=f"tags.`gr2.stage` = '{stage}' and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"], max_results=1
        )
        if runs and (series := run_curves(client, runs[0], stage)):
            out[stage] = series
    return out


def run_curves(client: Any, run: Any, stage: str) -> dict[str, Curve]:
    """The CURVE_KEYS series of `stage` from one MLflow run's step metrics (`run`: an mlflow Run)."""
    wanted = [k for k in CURVE_KEYS.get(stage, ()) if k != "signal_share"]
    if "signal_share" in CURVE_KEYS.get(stage, ()):
        wanted += ["kept_groups", "sampled_groups"]
    raw = {}
    for key in wanted:
        if key in run.data.metrics:
            hist = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
            raw[key] = [(int(m.step), float(m.value)) for m in hist if math.isfinite(m.value)]
    # A lone point at step 0 is a final summary logged under the same name, not a curve;
    # a lone point later on (one validation at the end of training) is still worth a marker.
    series = {k: thin(v) for k, v in raw.items() if k in CURVE_KEYS[stage] and (len(v) > 1 or (v and v[0][0] > 0))}
    if "kept_groups" in raw and "sampled_groups" in raw:
        _with_signal_share(series, raw["kept_groups"], raw["sampled_groups"])
    return {k: series[k] for k in CURVE_KEYS[stage] if k in series}


FIGURES_DIR = "figures"  # the stage run's artifact folder for its figures


def log_stage_figures(stage: str, metrics: Mapping[str, Any], client: Any, run_id: str, root: Path, logger: Any) -> list[str]:
    """Draw the stage's figures (`tasks.report_html.stage_figures`) and log them to its own MLflow run as PNGs.

    The curves come from the stage's metrics' `history` when it has one, else from
    the step metrics its run logged. The flow calls this once a stage has run
    (flows/pipeline.run_stage), not the stage itself: tasks/common.py is a DVC
    dependency of every stage, so a hook there would make every stage out of date.
    A drawing or MLflow problem is a warning, never a failed stage. Returns the
    artifact paths logged.
    """
    if stage not in CURVE_KEYS and stage != "evaluate":
        return []
    try:
        from tasks.report_html import close_figure, stage_figures

        curves: dict[str, Curve] = {}
        if isinstance(metrics.get("history"), list):
            curves = curves_from_history(stage, metrics["history"])
        if not curves and stage in CURVE_KEYS:
            curves = run_curves(client, client.get_run(run_id), stage)
        speed = read_json(root / METRICS_DIR / f"{SPEED_STAGE}.json") if stage == "evaluate" else None
        logged = []
        for name, fig in stage_figures(stage, metrics, curves, speed).items():
            path = f"{FIGURES_DIR}/{name}.png"
            try:
                client.log_figure(run_id, fig, path)  # PNG: MLflow's UI previews it
            finally:
                close_figure(fig)
            logged.append(path)
        return logged
    except Exception as exc:
        logger.warning("%s: figures not logged to MLflow (%s: %s)", stage, type(exc).__name__, exc)
        return []


# --- the registry ------------------------------------------------------------------------------

REGISTERED_MODELS = ("gr2-retriever", "gr2", "diffusion-gr2", "spec-gr2")  # flows/registry.py registers them


def registry_rows(models: Sequence[str] = REGISTERED_MODELS) -> list[dict[str, Any]]:
    """One dict per registered version of `models` in the current MLflow store, newest first per model:
    model, version, aliases, stage, description, promotion decision and failed gates (from promotion tags)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient()
    rows = []
    for name in models:
        try:
            versions = client.search_model_versions(f"name = '{name}'")
        except MlflowException:
            continue
        for mv in sorted(versions, key=lambda v: -int(v.version)):
            tags = mv.tags or {}
            rows.append(
                {
                    "model": name,
                    "version": str(mv.version),
                    "aliases": list(getattr(mv, "aliases", []) or []),
                    "stage": tags.get("stage", ""),
                    "created": int(mv.creation_timestamp or 0),
                    "description": mv.description or "",
                    "decision": tags.get("promotion.decision", ""),
                    "failed_gates": tags.get("promotion.failed_gates", ""),
                }
            )
    return rows


# --- assembling and writing -------------------------------------------------------------------


def load_inputs(
    root: Path, *, evaluate: dict[str, Any] | None = None, with_mlflow: bool = True, with_registry: bool = True
) -> ReportInputs:
    """Everything on disk (and, if asked, in MLflow) that the report draws.

    Args:
        evaluate: the evaluation results to use instead of metrics/evaluate.json
            (the `evaluate` stage draws the report before its metrics file is written).
        with_mlflow: read the training curves from MLflow when no metrics file carries a history.
        with_registry: read the registered versions.
    """
    root = root.resolve()
    stage_metrics = read_stage_metrics(root)
    if evaluate is not None:
        stage_metrics["evaluate"] = evaluate
    inputs = ReportInputs(root=root, stage_metrics=stage_metrics, evaluate=stage_metrics.get("evaluate"), speed=stage_metrics.get(SPEED_STAGE))
    for stage, m in stage_metrics.items():
        if isinstance(m.get("history"), list) and stage in CURVE_KEYS:
            if series := curves_from_history(stage, m["history"]):
                inputs.curves[stage] = series
    if with_mlflow:
        missing = [s for s in CURVE_KEYS if s not in inputs.curves and s in stage_metrics]
        try:
            inputs.curves.update(mlflow_curves(root, missing) if missing else {})
        except Exception as exc:  # a store that cannot be read costs the curves, not the report
            log.warning("training curves not read from MLflow: %s", exc)
            inputs.curves_note = f"the MLflow store could not be read ({type(exc).__name__})"
    else:
        inputs.curves_note = inputs.curves_note or "MLflow tracking is off, and no metrics file carries a history"
    if with_registry:
        try:
            inputs.registry = registry_rows()
        except Exception as exc:
            log.warning("registry not read from MLflow: %s", exc)
            inputs.registry_note = f"the MLflow registry could not be read ({type(exc).__name__})"
    else:
        inputs.registry_note = "not read (written without MLflow); `gr2 report` adds it"
    return inputs


def write_report(inputs: ReportInputs, path: Path | None = None) -> Path:
    """Draw the report and write it atomically (a browser never opens half a file); returns its path."""
    from tasks.common import write_text_atomic
    from tasks.report_html import render_html

    path = path or inputs.root / REPORT_HTML
    write_text_atomic(render_html(inputs), path)
    return path


# --- the report as a Prefect artifact ---------------------------------------------------------


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def report_markdown(root: Path, summaries: Sequence[Mapping[str, Any]]) -> str:
    """The report's key tables in markdown, for the flow run's artifact (Prefect's UI renders it).

    One row per stage of this run (status, seconds, headline), the test ablation
    (R@1 with its interval, valid-permutation rate) and the speed-up at parity
    when `evaluate` has written them, and where the full report is. `summaries`
    are the flow's stage summaries (`stage`, `status`, `seconds`, `metrics`).
    """
    root = root.resolve()
    speed = read_json(root / METRICS_DIR / f"{SPEED_STAGE}.json")
    lines = ["## Diffusion-GR2 pipeline", "", "| stage | status | seconds | headline |", "|---|---|---:|---|"]
    for s in summaries:
        head = stage_headline(root, s["stage"], s.get("metrics"))
        status = "ran" if s.get("status") == "ran" else "skipped (up to date)"
        lines.append(f"| {_md_cell(s['stage'])} | {status} | {float(s.get('seconds') or 0.0):.1f} | {_md_cell(head or '-')} |")
    evaluate = read_json(root / METRICS_DIR / "evaluate.json")
    if evaluate:
        split = "test" if any("test" in (evaluate.get(m) or {}) for m in evaluate) else "valid"
        rows = [m for m in ABLATION_ROWS if isinstance(dig(evaluate, f"{m}.{split}"), Mapping)]
        rows += sorted(m for m in evaluate if m.startswith(SPEC_PREFIX) and isinstance(dig(evaluate, f"{m}.{split}"), Mapping))
        if rows:
            lines += ["", f"### Ablation ({split})", "", "| model | R@1 | R@1 95% CI | valid perm | n |", "|---|---:|---|---:|---:|"]
            for m in rows:
                r = evaluate[m][split]
                ci = r.get("recall@1_ci95")
                ci_text = f"[{ci[0]:.4f}, {ci[1]:.4f}]" if isinstance(ci, list) and len(ci) == 2 else "-"
                r1, vp = _number(r.get("recall@1")), _number(r.get("valid_permutation_rate"))
                n = _number(r.get("n"))
                lines.append(
                    f"| {_md_cell(m)} | {'-' if r1 is None else f'{r1:.4f}'} | {ci_text} | {'-' if vp is None else f'{vp:.4f}'} | {'-' if n is None else int(n)} |"
                )
    rows_speed = (speed or {}).get("rows") or []
    if rows_speed:
        p = parity_point(rows_speed, 1)
        at_parity = f"{float(p['speedup']):.2f}x ({p.get('model')}, {setting_label(p)})" if p else "none"
        lines += ["", f"Speed-up at parity (batch 1): {at_parity}."]
    report = root / REPORT_HTML
    lines += [""]
    if report.exists():
        lines.append(f"Full report, offline (tables and figures): `{report}` (open file://{report}; `gr2 report` redraws it).")
    else:
        lines.append("No reports/index.html yet: the `evaluate` stage writes it, `gr2 report` draws it from the metrics on disk.")
    return "\n".join(lines) + "\n"
