"""Scheduled retraining: the Prefect flow `gr2-retrain` and the one command that serves it on a schedule.

    gr2 schedule serve        # a local Prefect server (unless PREFECT_API_URL answers) + the deployment; Ctrl-C stops both
    gr2 schedule run          # one retraining now, no schedule (the same flow)

Each run of `gr2-retrain`, configured by the `schedule:` section of params.yaml:
1. refresh: snapshot `schedule.source` into `prepare.data_dir` (a DVC-tracked
   folder inside the project; its pointer committed to git, its files pushed),
   so every version's lineage names the exact data it was trained on
   (flows/snapshot.py). `source: null` skips this and reads the data in place;
2. the pipeline flow: DVC reruns only the stages whose inputs changed (a new
   snapshot reruns `prepare`; later stages only if their inputs changed), new
   checkpoints are registered with the alias `challenger`;
3. `dvc push` of everything to the default remote (`schedule.push`), so any
   version can be rebuilt by hash (`gr2 reproduce`);
4. each model in `schedule.promote` is judged through the gates in
   `promote.models` (flows/promote.py): `champion` moves only if they pass.

Schedules need a long-lived Prefect API: against the temporary one that a plain
`gr2 run` starts, `serve` runs nothing (shared/notes/STACK.md). `serve` below
starts `prefect server start` on a loopback port when no API answers, serves
the deployment (at most one run at a time), and stops the server it started,
by its process id, when it is stopped itself (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import BaseModel

from flows import snapshot as snap
from tasks.common import load_stage_config, read_params

SECTION = "schedule"  # params.yaml section (not a DVC stage)
FLOW_NAME = "gr2-retrain"
DEPLOYMENT = "gr2-retrain"


class ScheduleConfig(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}

    cron: str = "0 4 * * 1"  # Mondays 04:00
    timezone: str = "UTC"
    source: str | None = None  # folder new raw data lands in; null: no refresh
    promote: list[str] = ["gr2", "diffusion-gr2", "spec-gr2"]
    commit: bool = True  # commit the snapshot's pointer file (clean git lineage for the versions)
    push: bool = True  # dvc push after the run


def load_schedule_config(root: Path) -> ScheduleConfig:
    """The `schedule:` section of `<root>/params.yaml` (defaults when there is none)."""
    path = root / "params.yaml"
    if SECTION not in read_params(path):
        return ScheduleConfig()
    return load_stage_config(SECTION, ScheduleConfig, path)


# ---------------------------------------------------------------------------
# The flow


@task(name="refresh-data", cache_policy=NO_CACHE)
def refresh_data(root: str) -> dict[str, Any]:
    """Snapshot `schedule.source` into `prepare.data_dir` (DVC-versioned, pointer committed)."""
    rootp = Path(root)
    cfg = load_schedule_config(rootp)
    logger = get_run_logger()
    if not cfg.source:
        logger.info("schedule.source is null: no refresh, prepare reads %s in place", snap.data_dir(rootp))
        return {"path": snap.data_dir(rootp), "md5": None, "changed": None, "commit": None, "pushed": False}
    result = snap.snapshot_data(rootp, Path(cfg.source), commit=cfg.commit, push=cfg.push)
    logger.info(
        "snapshot %s: %s (%s)%s",
        result["path"],
        result["md5"],
        "new content" if result["changed"] else "unchanged",
        f"; committed {result['commit'][:12]}" if result["commit"] else "",
    )
    if snap.git(rootp, "status", "--porcelain", "--untracked-files=no", check=False).stdout.strip():
        logger.warning("the git tree has uncommitted changes: versions registered by this run will be flagged not reproducible")
    return result


@task(name="dvc-push", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def push_task(root: str) -> bool:
    """Push the data and checkpoints to the default DVC remote."""
    pushed = snap.push(Path(root))
    get_run_logger().info("dvc push: %s", "done" if pushed else "no default remote, skipped")
    return pushed


@task(name="promote", cache_policy=NO_CACHE)
def promote_task(model: str, root: str) -> dict[str, Any]:
    """Judge the model's challenger through its gates; a model with nothing to judge is reported, not fatal."""
    from flows.promote import PromotionError, promote

    logger = get_run_logger()
    try:
        decision = promote(model, None, Path(root), flow_run_id=str(flow_run.get_id() or ""))
    except PromotionError as exc:
        logger.warning("%s: not promoted: %s", model, exc)
        return {"model": model, "status": "error", "summary": str(exc)}
    logger.info("%s\n%s", decision.summary(), decision.table())
    return {"model": model, "version": decision.version, "status": decision.status, "summary": decision.summary()}


@flow(name=FLOW_NAME, log_prints=True)
def retrain(root: str = ".") -> dict[str, Any]:
    """Refresh the data, rerun what changed, register, push, promote (see the module docstring)."""
    from flows.pipeline import pipeline
    from tasks.tracking import configure

    rootp = Path(root).resolve()
    os.environ["GR2_ROOT"] = str(rootp)
    os.environ.setdefault("GR2_TRACKING", "on")
    configure(rootp)
    cfg = load_schedule_config(rootp)
    snapshot = refresh_data(str(rootp))
    summaries = pipeline(root=str(rootp))
    pushed = push_task(str(rootp)) if cfg.push else False
    promotions = [promote_task.with_options(name=f"promote-{m}")(m, str(rootp)) for m in cfg.promote]
    result = {
        "snapshot": snapshot,
        "stages": {s["stage"]: s["status"] for s in summaries},
        "registered": [s["registered"] for s in summaries if s.get("registered")],
        "pushed": pushed,
        "promotions": promotions,
    }
    lines = [f"# Retraining of {rootp}", ""]
    if snapshot.get("md5"):
        lines.append(f"Data snapshot `{snapshot['path']}`: {snapshot['md5']} ({'new content' if snapshot['changed'] else 'unchanged'})")
    lines += ["", "| stage | status |", "|---|---|"] + [f"| {k} | {v} |" for k, v in result["stages"].items()]
    lines += [""] + [f"- registered {r['model']} version {r['version']} ({'new' if r['created'] else 'existing'})" for r in result["registered"]]
    lines += [""] + [f"- {p['summary']}" for p in promotions]
    create_markdown_artifact("\n".join(lines), key="gr2-retrain", description="what this scheduled retraining did")
    return result


# ---------------------------------------------------------------------------
# Serving on a schedule


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def api_healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as resp:
            return resp.status == 200
    except OSError:
        return False


def start_server(host: str, port: int, home: Path | None = None, wait_s: float = 120.0) -> tuple[subprocess.Popen[bytes], str]:
    """`prefect server start` on host:port in its own process group; returns (process, API URL) once it answers.

    The server gets its own session so a Ctrl-C in the terminal reaches only the
    serving process, which then stops the server itself (`stop_server`).
    """
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    env.pop("PREFECT_API_URL", None)
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    log_path = Path(env.get("PREFECT_HOME", Path.home() / ".prefect")) / f"server-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    api = f"http://{host}:{port}/api"
    deadline = time.monotonic() + wait_s
    try:
        while not api_healthy(api):
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not answer on {api} within {wait_s:.0f} s; see {log_path}")
            time.sleep(0.5)
    except BaseException:  # a failed start, Ctrl-C or SIGTERM while waiting: leave nothing running
        stop_server(proc)
        raise
    return proc, api


def stop_server(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Stop a server started by `start_server`: SIGTERM to its process group (its id is the server's pid), then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def serve(
    root: Path,
    interval_s: float | None = None,
    cron: str | None = None,
    name: str = DEPLOYMENT,
    host: str = "127.0.0.1",
    port: int = 4200,
    start_api: bool = True,
    on_ready: Any = None,
) -> None:
    """Serve `gr2-retrain` for `root` on its schedule (params `schedule.cron`, or `cron` / `interval_s`).

    Uses the API at PREFECT_API_URL (or a server already answering on
    host:port) when there is one; otherwise (and with `start_api`) starts a
    local server on host:port first and stops it on the way out. Blocks until SIGTERM or Ctrl-C. `on_ready(api_url, server_pid)` is
    called once the API answers (the CLI prints it).
    """
    from prefect.schedules import Cron, Interval
    from prefect.settings import PREFECT_API_URL, temporary_settings

    root = root.resolve()
    cfg = load_schedule_config(root)

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    # Until the runner installs its own handler (a graceful stop), SIGTERM unwinds
    # through the finally below, which stops the server this process started.
    previous = signal.signal(signal.SIGTERM, _exit)
    server = None
    try:
        api = os.environ.get("PREFECT_API_URL")
        if not api and api_healthy(f"http://{host}:{port}/api"):
            api = f"http://{host}:{port}/api"  # a server someone already started there
        if not (api and api_healthy(api)):
            if not start_api:
                raise RuntimeError(f"no Prefect API answers at {api or 'PREFECT_API_URL (unset)'}; start one with `prefect server start`")
            server, api = start_server(host, port)
        os.environ["PREFECT_API_URL"] = api
        if on_ready:
            on_ready(api, server.pid if server else None)
        if interval_s:
            schedule = Interval(timedelta(seconds=interval_s), timezone=cfg.timezone)
        else:
            schedule = Cron(cron or cfg.cron, timezone=cfg.timezone)
        with temporary_settings(updates={PREFECT_API_URL: api}):
            retrain.serve(
                name=name,
                schedules=[schedule],
                parameters={"root": str(root)},
                description=f"scheduled retraining of {root}",
                tags=["gr2", "retrain"],
                limit=1,  # runs never overlap: a late run waits for the one in progress
                pause_on_shutdown=True,
            )
    finally:
        signal.signal(signal.SIGTERM, previous)
        if server is not None:
            stop_server(server)
