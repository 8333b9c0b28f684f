"""MLflow tracking for stage executions: one run per stage, nested under the flow's run.

The flow creates each stage's run (so it can tag it with DVC's hashes afterwards
and register its model) and hands its id to the stage process in MLFLOW_RUN_ID;
`dvc repro` or `python -m tasks.<stage>` run by hand get a fresh top-level run.
`import mlflow` costs 1-2 s, so it happens inside functions, never at import.
Set GR2_TRACKING=off to run a stage with no tracking at all (unit tests).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

EXPERIMENT = "diffusion-gr2"
log = logging.getLogger("tasks.tracking")


def project_root() -> Path:
    """The folder holding dvc.yaml: the current folder for stages run by DVC."""
    return Path(os.environ.get("GR2_ROOT", Path.cwd())).resolve()


def configure(root: Path | None = None) -> str:
    """Point MLflow at the project's embedded store unless the user chose a server.

    Returns the tracking URI in use. The default is SQLite in the project folder
    with artifacts in `<root>/mlruns`, so no server is needed.
    """
    root = (root or project_root()).resolve()
    uri = os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    return uri


def experiment_id(root: Path | None = None) -> str:
    """Create (once) and return the project's experiment, artifacts kept in the project folder."""
    import mlflow

    root = (root or project_root()).resolve()
    configure(root)
    name = os.environ.get("GR2_EXPERIMENT", EXPERIMENT)
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return mlflow.create_experiment(name, artifact_location=(root / "mlruns").as_uri())
    except Exception:  # another process created it at the same moment
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def git_lineage(root: Path) -> dict[str, str]:
    """`git.commit` and `git.dirty` of the project folder ("unknown" outside git)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        # Untracked DVC outputs are gitignored; anything else changed means the
        # code or params that made this run are not the committed ones. dvc.lock
        # is the exception: the pipeline rewrites it stage by stage (so a run from a
        # commit that tracks it would mark every later stage dirty), and each
        # registered version carries its own copy (lineage/dvc.lock).
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)dvc.lock"))
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"git.commit": "unknown", "git.dirty": "unknown"}
    return {"git.commit": commit, "git.dirty": str(dirty).lower()}


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` for MLflow params."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def metric_key(name: str) -> str:
    """MLflow-safe key: `recall@10` -> `recall_at_10` (MLflow rejects '@' in names)."""
    return name.replace("@", "_at_")


class StageTracker:
    """What a stage logs through: params, per-step metrics, final metrics, tags.

    A disabled tracker (GR2_TRACKING=off) accepts the same calls and drops them.
    """

    def __init__(self, run_id: str | None):
        self.run_id = run_id

    @property
    def enabled(self) -> bool:
        return self.run_id is not None

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.enabled:
            import mlflow

            flat = {k: str(v)[:6000] for k, v in flatten(params).items()}
            mlflow.log_params(flat)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Numeric entries of a (possibly nested) dict; nested keys joined with '.'."""
        if self.enabled:
            import mlflow

            flat = {metric_key(k): float(v) for k, v in flatten(metrics).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if flat:
                mlflow.log_metrics(flat, step=step)

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        """A training loop's per-step metrics (an `on_step` callback), at their "step" (0 when absent)."""
        self.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics.get("step", 0)))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.enabled:
            import mlflow

            mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_artifact(self, path: Path) -> None:
        if self.enabled:
            import mlflow

            mlflow.log_artifact(str(path))


@contextmanager
def stage_run(stage: str, params: Mapping[str, Any]) -> Iterator[StageTracker]:
    """The MLflow run of one stage execution, with params and lineage tags logged.

    Resumes the run the flow created (MLFLOW_RUN_ID) or starts a new one named
    after the stage. The run ends FAILED if the stage raises.
    """
    if os.environ.get("GR2_TRACKING", "on").lower() in {"off", "0", "false"}:
        yield StageTracker(None)
        return
    import mlflow

    root = project_root()
    exp = experiment_id(root)
    tags = {"gr2.stage": stage, **git_lineage(root)}
    # With MLFLOW_RUN_ID set (the flow made the run) start_run ignores its other
    # arguments, so the tags are set explicitly either way.
    with mlflow.start_run(experiment_id=exp, run_name=stage) as run:
        tracker = StageTracker(run.info.run_id)
        tracker.set_tags(tags)
        tracker.log_params(params)
        log.info("MLflow run %s (%s)", run.info.run_id, stage)
        yield tracker
