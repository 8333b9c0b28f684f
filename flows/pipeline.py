"""The pipeline flow: every DVC stage as a Prefect task, tracked in MLflow, models registered.

Order comes from DVC's graph (dvc.yaml), never from a list here. Each stage runs
through `dvc repro --single-item`, so DVC decides what is up to date and records
what made what in dvc.lock; Prefect adds status, timing, logs, retries and
artifacts; MLflow gets one run per executed stage, nested under the flow's run,
tagged with git and DVC lineage. No Prefect result caching is stacked on DVC's.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows import dvc_stages
from flows.console import stage_lines
from flows.promote import record_evaluations_task
from flows.registry import MODEL_STAGES, SPEC_MODEL, SPEC_STAGE, VERIFIER, register_checkpoint, register_speculative, speculative_pairs
from flows.reproduce import record_lineage, runtime_tags
from tasks.report import REPORT_HTML, log_stage_figures, report_markdown, stage_headline
from tasks.tracking import close_stale_runs, configure, experiment_id, flatten, git_lineage, metric_key, owner_tags


def check_params(root: Path) -> None:
    """Every section of `<root>/params.yaml` the pipeline reads, and the rules across fields and stages,
    checked before any stage starts: a bad value fails now, naming the file and the field, not hours in,
    at the start (or in the middle) of the stage that reads it. Reads only; writes nothing.

    Each stage's section is validated into its `tasks.<stage>.CONFIG` (bounds, and the rules inside a
    section such as traces' `unlabelled_lists` needing mode `distill`), as the stage itself will;
    `resume`, `serve` and `promote` likewise; then the rules between stages (`_cross_stage_problems`).

    Raises:
        ParamsError: every problem found, one per line.
    """
    import importlib

    from flows.promote import load_promote_config
    from flows.registry import load_serve_limits
    from tasks.common import STAGES, ParamsError, load_resume_config, load_stage_config, read_params

    path = root / "params.yaml"
    read_params(path)  # a missing or malformed file is one clear line
    problems: list[str] = []
    configs: dict[str, Any] = {}
    for stage in STAGES:
        try:
            configs[stage] = load_stage_config(stage, importlib.import_module(f"tasks.{stage}").CONFIG, path)
        except ParamsError as exc:
            problems.append(str(exc))
    for load in (lambda: load_resume_config(path), lambda: load_serve_limits(root), lambda: load_promote_config(root)):
        try:
            load()
        except ParamsError as exc:
            problems.append(str(exc))
    problems += _cross_stage_problems(path, configs)
    if problems:
        raise ParamsError("\n".join(problems))


def _cross_stage_problems(path: Path, configs: dict[str, Any]) -> list[str]:
    """The rules between stages' params that no one section can check, each a line naming both fields.

    - Sub-block sizes (evaluate's accuracy rows and explanation, OPD's and RL's rollouts) must divide
      the block size CFT gives the diffusion checkpoints (`cft.train.block_size`); otherwise the stage
      would fail at its first decode (`gr2model.eval.rerank_eval.decoder_kwargs`).
    - The bench's cached sub-block rows need their size among the bench's sub-block rows (which
      always include `evaluate.sub_block_size`, the served setting); otherwise `decode_benchmark`
      would fail at the end of evaluate.
    """
    problems = []
    cft, evaluate = configs.get("cft"), configs.get("evaluate")
    block = getattr(getattr(cft, "train", None), "block_size", None)
    if block is not None:
        sizes = {}
        if evaluate is not None:
            sizes["evaluate.sub_block_size"] = evaluate.sub_block_size
            sizes["evaluate.explanation_sub_block_size"] = evaluate.explanation_sub_block_size
        for stage in ("opd", "rl"):
            if (cfg := configs.get(stage)) is not None:
                sizes[f"{stage}.train.sub_block_size"] = getattr(cfg.train, "sub_block_size", None)
        for field, size in sizes.items():
            if size is not None and block % size:
                problems.append(f"{path}: {field}: {size} does not divide cft.train.block_size {block} (the diffusion checkpoints' block)")
    if evaluate is not None:
        bench = evaluate.bench
        rows = set(bench.sub_block_sizes) | ({evaluate.sub_block_size} if evaluate.sub_block_size is not None else set())
        if missing := sorted(set(bench.sub_block_cache_sizes) - rows):
            problems.append(f"{path}: evaluate.bench.sub_block_cache_sizes: {missing} not among evaluate.bench.sub_block_sizes {list(bench.sub_block_sizes)}")
    return problems


def _read_metrics(root: Path, stage: str) -> dict[str, Any]:
    path = root / "metrics" / f"{stage}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def artifact_key(stage: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only: `ar_rl` -> `stage-ar-rl`."""
    return "stage-" + stage.replace("_", "-")


def _stage_artifact(root: Path, summary: dict[str, Any]) -> None:
    """The stage's headline as a markdown artifact of its task run (the task run is named after the stage)."""
    stage = summary["stage"]
    ran = summary["status"] == "ran"
    status = f"ran in {summary['seconds']:.1f} s" if ran else "skipped (up to date)"
    lines = [f"### {stage}: {status}", "", stage_headline(root, stage, summary["metrics"]) or "(no headline metrics)"]
    if ran:
        figures = f"; figures: {', '.join(f'`{f}`' for f in summary['figures'])}" if summary.get("figures") else ""
        lines += ["", f"MLflow run `{summary['run_id']}`{figures}"]
    create_markdown_artifact("\n".join(lines) + "\n", key=artifact_key(stage), description=f"stage {stage}: headline metrics")


# Retrying a stage is safe: every stage writes its outputs to temporary names
# and renames them, and DVC reruns it from its inputs.
@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def run_stage(stage: str, root: str, parent_run_id: str, force: bool = False) -> dict[str, Any]:
    """Run one DVC stage if its inputs changed; returns status, seconds, MLflow run id and metrics."""
    from mlflow import MlflowClient

    logger = get_run_logger()
    rootp = Path(root)
    if not force and stage not in dvc_stages.changed_stages(rootp):
        logger.info("stage %s is up to date (DVC): skipped", stage)
        summary = {"stage": stage, "status": "skipped", "seconds": 0.0, "run_id": None, "metrics": _read_metrics(rootp, stage)}
        _stage_artifact(rootp, summary)
        return summary

    client = MlflowClient()
    tags = {
        "mlflow.parentRunId": parent_run_id,
        "gr2.stage": stage,
        "prefect.flow_run_id": str(flow_run.get_id() or ""),
        **git_lineage(rootp),
        **owner_tags(rootp),
    }
    run = client.create_run(experiment_id(rootp), run_name=stage, tags=tags)
    run_id = run.info.run_id
    logger.info("stage %s: running (MLflow run %s)", stage, run_id)
    start = time.perf_counter()
    try:
        dvc_stages.repro(rootp, stage, env={"MLFLOW_RUN_ID": run_id, "GR2_ROOT": str(rootp)}, force=force)
    except BaseException as exc:
        # A Ctrl-C is no failure of the stage (and Prefect does not retry it).
        client.set_terminated(run_id, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        raise
    seconds = round(time.perf_counter() - start, 1)
    for key, value in dvc_stages.lineage_tags(rootp, stage).items():
        client.set_tag(run_id, key, value)
    client.log_metric(run_id, "stage_seconds", seconds)
    logger.info("stage %s: done in %.1f s", stage, seconds)
    metrics = _read_metrics(rootp, stage)
    # The report's figures of this stage on its own run (after the stage, by the flow: see log_stage_figures).
    figures = log_stage_figures(stage, metrics, client, run_id, rootp, logger)
    # A stage process ends the run it was handed; under GR2_TRACKING=off it never opens it, and
    # the run would show RUNNING until the next `gr2 run` marks it KILLED.
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, "FINISHED")
    summary = {"stage": stage, "status": "ran", "seconds": seconds, "run_id": run_id, "metrics": metrics, "figures": figures}
    _stage_artifact(rootp, summary)
    return summary


@task(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def register_model(stage: str, root: str, summary: dict[str, Any]) -> dict[str, Any]:
    """Register the stage's checkpoint (once per DVC hash) with lineage tags and alias `challenger`."""
    from mlflow import MlflowClient

    logger = get_run_logger()
    rootp = Path(root)
    spec = MODEL_STAGES[stage]
    entry = dvc_stages.lock_entry(rootp, stage)
    md5 = entry["outs"].get(spec.checkpoint)
    if not md5:
        raise RuntimeError(f"dvc.lock has no hash for {spec.checkpoint}; did stage '{stage}' run?")
    run_id = summary["run_id"]
    if run_id is None:
        # Skipped by DVC: register against the run that made this checkpoint, if it is in this store.
        found = MlflowClient().search_runs(
            [experiment_id(rootp)], filter_string=f"tags.`dvc.out.{spec.checkpoint}` = '{md5}'", max_results=1
        )
        if not found:
            logger.info("%s: checkpoint %s has no MLflow run in this store; not registering", spec.model_name, md5)
            return {"model": spec.model_name, "version": None, "created": False}
        run_id = found[0].info.run_id
    # How the stage ran (launcher, processes, accelerate config: its own run's runtime.* tags) over
    # this process's view (threads, versions): what `gr2 reproduce` reruns with.
    launched = {k: v for k, v in MlflowClient().get_run(run_id).data.tags.items() if k.startswith("runtime.")}
    tags = {
        **git_lineage(rootp),
        **dvc_stages.lineage_tags(rootp, stage),
        **runtime_tags(),
        **launched,
        "prefect.flow_run_id": str(flow_run.get_id() or ""),
    }
    # The evaluation numbers travel with the version so promotion can read them.
    for key, value in flatten(summary["metrics"]).items():
        if isinstance(value, (int, float)) and key.split(".")[0] in {"full_ranking", "rerank"}:
            tags[metric_key(f"metric.{key}")] = str(value)
    version, created = register_checkpoint(spec, rootp, md5, run_id, tags)
    if created:
        # dvc.lock and the metrics as they are now: what `gr2 reproduce` rebuilds and compares against.
        record_lineage(MlflowClient(), rootp, stage, run_id)
    logger.info("%s version %s (%s)", spec.model_name, version, "new" if created else "already registered")
    return {"model": spec.model_name, "version": version, "created": created}


@task(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def register_speculative_model(root: str, summary: dict[str, Any]) -> dict[str, Any] | None:
    """Register the pair `evaluate` measured (GR2 verifying a diffusion model's drafts) as a version of
    `spec-gr2`, once per pair of checkpoint hashes, with lineage to both; None when there is no pair."""
    from mlflow import MlflowClient

    logger = get_run_logger()
    rootp = Path(root)
    pairs = speculative_pairs(rootp)
    if not pairs:
        logger.info("no speculative row with a drafter checkpoint in metrics/evaluate.json; %s not registered", SPEC_MODEL)
        return None
    pair = pairs[0]  # evaluate measures one drafter (evaluate.spec_drafter)
    drafter = MODEL_STAGES[pair.drafter_stage].checkpoint
    run_id = summary["run_id"]
    if run_id is None:
        # Skipped by DVC: register against the evaluate run that read these two checkpoints, if it is in this store.
        found = MlflowClient().search_runs(
            [experiment_id(rootp)],
            filter_string=(
                f"tags.`gr2.stage` = '{SPEC_STAGE}' and tags.`dvc.dep.{VERIFIER.checkpoint}` = '{pair.verifier_md5}' "
                f"and tags.`dvc.dep.{drafter}` = '{pair.drafter_md5}'"
            ),
            max_results=1,
        )
        if not found:
            logger.info("%s: no %s run in this store read checkpoints %s; not registering", SPEC_MODEL, SPEC_STAGE, pair.checkpoint_md5)
            return None
        run_id = found[0].info.run_id
    tags = {**git_lineage(rootp), **dvc_stages.lineage_tags(rootp, SPEC_STAGE), **runtime_tags(), "prefect.flow_run_id": str(flow_run.get_id() or "")}
    version, created = register_speculative(pair, rootp, run_id, tags)
    logger.info("%s version %s (%s)", SPEC_MODEL, version, "new" if created else "already registered")
    return {"model": SPEC_MODEL, "version": version, "created": created}


def _mark_flow_runs_crashed(client: Any, run_ids: list[str], logger: Any) -> None:
    """Mark the Prefect flow runs behind closed MLflow pipeline runs as Crashed, as Prefect would had it seen the death.

    A flow run lives in the Prefect database of the API it ran against; one that
    this API does not know (another Prefect home, a test harness) is only logged.
    """
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    tags = [client.get_run(r).data.tags for r in run_ids]
    # Only the pipeline's own run (no gr2.stage tag) stands for the flow run; its stages share the id.
    ids = {t.get("prefect.flow_run_id") for t in tags if "gr2.stage" not in t} - {None, ""}
    if not ids:
        return
    with get_client(sync_client=True) as prefect:
        for fid in sorted(ids):
            try:
                state = prefect.read_flow_run(fid).state
                if state is not None and not state.is_final():
                    prefect.set_flow_run_state(fid, Crashed(message="its process died; found by a later gr2 run"), force=True)
                    logger.warning("Prefect flow run %s (state %s) marked Crashed", fid, state.name)
            except Exception as exc:  # not in this Prefect database: nothing to mark
                logger.info("Prefect flow run %s not marked crashed: %s", fid, exc)


def _summary_table(summaries: list[dict[str, Any]], root: Path) -> list[dict[str, Any]]:
    rows = []
    for s in summaries:
        m = s["metrics"]
        rows.append(
            {
                "stage": s["stage"],
                "status": s["status"],
                "seconds": s["seconds"],
                "headline": stage_headline(root, s["stage"], s["metrics"]),
                "mlflow_run": s["run_id"] or "",
                "metrics": ", ".join(f"{k}={v}" for k, v in m.items() if isinstance(v, (int, float)))[:300],
            }
        )
    return rows


def _publish_report(root: Path, summaries: list[dict[str, Any]]) -> None:
    """The report on the flow run: its key tables as markdown, and a link to reports/index.html when it exists.

    The page itself stays on disk (it is self-contained, so a browser opens it
    offline); a file:// link from Prefect's web UI may be blocked by the browser,
    so the markdown names the path too.
    """
    create_markdown_artifact(report_markdown(root, summaries), key="gr2-report", description="key tables of reports/index.html")
    page = root / REPORT_HTML
    if page.exists():
        create_link_artifact(page.as_uri(), link_text=str(page), key="gr2-report-html", description="the offline report (tables and figures)")


@flow(name="gr2-pipeline", log_prints=True)
def pipeline(root: str = ".", stages: list[str] | None = None, force: bool = False) -> list[dict[str, Any]]:
    """Run the DVC stages in graph order (all, or up to and including the named ones)."""
    from mlflow import MlflowClient

    logger = get_run_logger()
    rootp = Path(root).resolve()
    check_params(rootp)  # before any stage, run or file: a bad value names params.yaml and its field
    os.environ["GR2_ROOT"] = str(rootp)
    configure(rootp)
    order = dvc_stages.stage_order(rootp)
    if stages:
        unknown = sorted(set(stages) - set(order))
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; dvc.yaml has {order}")
        last = max(order.index(s) for s in stages)
        order = order[: last + 1]
    logger.info("stages in DVC order: %s", " -> ".join(order))
    # The stages read it themselves (tasks.common.stage_main); dvc.yaml's commands stay as they are.
    launch = os.environ.get("GR2_LAUNCH", "").strip()
    logger.info("multi-process stages run under %s", f"GR2_LAUNCH={launch!r}" if launch else "one process each (GR2_LAUNCH unset)")

    client = MlflowClient()
    # Runs left RUNNING by an earlier run of this workspace that died say so now.
    stale = close_stale_runs(rootp, client, logger)
    _mark_flow_runs_crashed(client, stale, logger)
    parent = client.create_run(
        experiment_id(rootp),
        run_name="pipeline",
        tags={"prefect.flow_run_id": str(flow_run.get_id() or ""), **git_lineage(rootp), **owner_tags(rootp)},
    )
    parent_id = parent.info.run_id
    summaries: list[dict[str, Any]] = []
    status = "FAILED"
    try:
        for position, stage in enumerate(order, 1):
            # One console line as the stage starts, one as it ends (flows/console.py).
            with stage_lines(position, len(order), stage, rootp) as lines:
                summary = run_stage.with_options(name=stage, task_run_name=stage)(stage, str(rootp), parent_id, force)
                if stage in MODEL_STAGES:
                    summary["registered"] = register_model.with_options(name=f"register-{stage}", task_run_name=f"register-{stage}")(stage, str(rootp), summary)
                elif stage == SPEC_STAGE and (
                    spec := register_speculative_model.with_options(name="register-spec-gr2", task_run_name="register-spec-gr2")(str(rootp), summary)
                ):
                    summary["registered"] = spec
                lines["summary"] = summary
            summaries.append(summary)
        # After evaluate (and any later stage): each registered version gets its checkpoint's
        # eval metrics, decode speed and params hash as tags, which promotion reads.
        record_evaluations_task(str(rootp))
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        client.set_terminated(parent_id, status)
        if summaries:
            create_table_artifact(_summary_table(summaries, rootp), key="gr2-pipeline-stages", description="Stages of this run")
            md = "\n\n".join(f"### {s['stage']} ({s['status']})\n```json\n{json.dumps(s['metrics'], indent=2)}\n```" for s in summaries)
            create_markdown_artifact(md, key="gr2-pipeline-metrics", description="metrics/<stage>.json of every stage")
            # The paper's two tables (accuracy ablation, decode speed) as artifacts of the run that made them.
            for name, report in (("evaluation", "reports/evaluate.md"), ("speed", "reports/speed.md")):
                if any(s["stage"] == "evaluate" and s["status"] == "ran" for s in summaries) and (rootp / report).exists():
                    create_markdown_artifact((rootp / report).read_text(), key=f"gr2-{name}", description=report)
            _publish_report(rootp, summaries)
    return summaries
