"""MLflow tracking for stage executions: one run per stage, nested under the flow's run.

The flow creates each stage's run (so it can tag it with DVC's hashes afterwards
and register its model) and hands its id to the stage process in MLFLOW_RUN_ID;
`dvc repro` or `python -m tasks.<stage>` run by hand get a fresh top-level run.
`import mlflow` costs 1-2 s, so it happens inside functions, never at import.
Set GR2_TRACKING=off to run a stage with no tracking at all (unit tests).

Every run carries the process that owns it (`gr2.host`, `gr2.pid`,
`gr2.pid_start`, plus `gr2.stage_pid`/`gr2.stage_pid_start` of the stage
process that resumes it) and its workspace (`gr2.root`), so the next `gr2 run`
can tell a run whose process died (SIGKILL, out of memory, power loss) from one
still working, and close it as KILLED (`close_stale_runs`).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

EXPERIMENT = "diffusion-gr2"
# MLflow 3 opens an experiment without this tag on its GenAI overview (traces), which is
# empty here; with it the UI opens on the training runs.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
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
    key, kind = EXPERIMENT_KIND
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        if exp.tags.get(key) != kind:  # made before the tag existed: tag it once
            try:
                mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, key, kind)
            except Exception as exc:  # a UI nicety: never worth failing a stage over
                log.warning("experiment %s not tagged %s=%s: %s", name, key, kind, exc)
        return exp.experiment_id
    try:
        return mlflow.create_experiment(name, artifact_location=(root / "mlruns").as_uri(), tags={key: kind})
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


def process_start(pid: int) -> str | None:
    """A running process's start time (clock ticks since boot, from /proc), or None if it is not running.

    The start time tells a process from a later one that reused its pid. Where
    /proc is missing it is "" for a live pid (the pid alone is then the identity).
    A zombie (exited, not yet reaped) counts as not running.
    """
    if pid <= 0:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's
            return ""
        return ""
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def process_alive(pid: int, start: str | None = None) -> bool:
    """Whether `pid` runs and, when its recorded `start` is known, is the same process that recorded it."""
    now = process_start(pid)
    if now is None:
        return False
    return not (start and now and now != start)


def owner_tags(root: Path, prefix: str = "gr2.") -> dict[str, str]:
    """Tags naming this process and workspace as the owner of a run (see the module docstring).

    `prefix` "gr2.stage_" gives the stage process's pair (pid, pid_start) only.
    """
    pid = os.getpid()
    tags = {f"{prefix}pid": str(pid), f"{prefix}pid_start": process_start(pid) or ""}
    if prefix == "gr2.":
        tags |= {"gr2.host": socket.gethostname(), "gr2.root": str(root.resolve())}
    return tags


def owners_alive(tags: Mapping[str, str]) -> bool | None:
    """Whether any process recorded as owning a run still runs; None when that cannot be told here.

    None for a run from another host (its pids mean nothing here) or one that
    recorded no pid (made before these tags existed).
    """
    if tags.get("gr2.host") != socket.gethostname():
        return None
    pids = [(tags.get(f"{p}pid", ""), tags.get(f"{p}pid_start")) for p in ("gr2.", "gr2.stage_")]
    pids = [(int(pid), start) for pid, start in pids if pid.isdigit()]
    if not pids:
        return None
    return any(process_alive(pid, start) for pid, start in pids)


def close_stale_runs(root: Path, client: Any = None, logger: logging.Logger | logging.LoggerAdapter | None = None) -> list[str]:
    """End as KILLED every RUNNING run of this workspace whose owning processes are all gone.

    A SIGKILLed `gr2 run` (or stage process) never ends its MLflow runs, which
    would otherwise show RUNNING forever. Only runs tagged with this workspace
    (`gr2.root`) and this host are judged; a run whose owner still runs (another
    `gr2 run` at work, a stage process that outlived its flow) is left alone.
    Logs one line per closed run and returns their ids.
    """
    from mlflow import MlflowClient

    logger = logger or log
    root = root.resolve()
    client = client or MlflowClient()
    closed = []
    runs = client.search_runs([experiment_id(root)], filter_string="attributes.status = 'RUNNING'", max_results=1000)
    for run in runs:
        tags = run.data.tags
        if tags.get("gr2.root") != str(root) or owners_alive(tags) is not False:
            continue
        client.set_terminated(run.info.run_id, "KILLED")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.info.start_time / 1000))
        stage = tags.get("gr2.stage", "pipeline")
        owners = ", ".join(f"pid {tags[k]}" for k in ("gr2.pid", "gr2.stage_pid") if tags.get(k))
        logger.warning(
            "MLflow run %s (%s, started %s by %s on %s) was still RUNNING but its process is gone: marked KILLED",
            run.info.run_id, stage, started, owners, tags.get("gr2.host"),
        )  # fmt: skip
        closed.append(run.info.run_id)
    return closed


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
    tags = {"gr2.stage": stage, **git_lineage(root), **owner_tags(root, "gr2.stage_")}
    # With MLFLOW_RUN_ID set (the flow made the run) start_run ignores its other
    # arguments, so the tags are set explicitly either way. The flow's run already
    # names its owner (the `gr2 run` process); a run started here is owned by this one.
    resumed = bool(os.environ.get("MLFLOW_RUN_ID"))
    with mlflow.start_run(experiment_id=exp, run_name=stage) as run:
        tracker = StageTracker(run.info.run_id)
        tracker.set_tags(tags if resumed else {**tags, **owner_tags(root)})
        tracker.log_params(params)
        log.info("MLflow run %s (%s)", run.info.run_id, stage)
        yield tracker
