"""What the flow asks DVC: the stage order, whether a stage is up to date, the hashes it recorded.

The pipeline order is written once, in dvc.yaml; this module reads it from DVC's
own graph instead of keeping a second list.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from flows.console import parse_tqdm, stage_progress

log = logging.getLogger("flows.dvc")

DVC_ENV = {"DVC_NO_ANALYTICS": "1"}
PROGRESS_EVERY_S = 5.0
# A warning or error line of the stage's own loggers (tasks.common.stage_main's format:
# "<date> <time> <stage> <logger> <LEVEL> <message>"); group 1 is the message.
STAGE_WARNING = re.compile(r"^\S+ \S+ \S+ (?:tasks|gr2model|flows)(?:\.\S+)? (?:WARNING|ERROR) (.*)$")


def stage_order(root: Path) -> list[str]:
    """Stage names of dvc.yaml in an order that respects every dependency.

    Among stages whose dependencies are all done, dvc.yaml's own order decides,
    so the order is stable from run to run.
    """
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        # DVC's edges point from a stage to the stages it depends on.
        graph = repo.index.graph.reverse(copy=True)
        named = [s for s in graph.nodes if getattr(s, "name", None)]
        listed = list((yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {}))
        rank = {name: i for i, name in enumerate(listed)}
        order = nx.lexicographical_topological_sort(graph.subgraph(named), key=lambda s: rank.get(s.name, len(rank)))
        return [s.name for s in order]


def changed_stages(root: Path) -> set[str]:
    """Stages whose deps, params or outs differ from dvc.lock (what `dvc repro` would run)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        status = repo.status()
    return {key.split(":")[-1] for key in status}


def repro(root: Path, stage: str, env: dict[str, str] | None = None, force: bool = False) -> None:
    """Run one stage through the DVC CLI (the same path as a user's `dvc repro`).

    Output streams to this process's logs line by line (a progress bar's lines
    every few seconds only) and each state of the stage's tqdm bars to the
    console's live progress line; a failure raises with the stage's last lines.
    """
    cmd = [sys.executable, "-m", "dvc", "repro", "--single-item", stage]
    if force:
        cmd.append("--force")
    full_env = {**os.environ, **DVC_ENV, **(env or {})}
    # dvc.yaml says `python -m tasks.<stage>`: make that the interpreter running us
    # (the project's venv) even when the venv is not activated.
    full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
    proc = subprocess.Popen(cmd, cwd=root, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    try:
        tail = _follow(proc, stage)
    except KeyboardInterrupt:
        _stop_interrupted(proc, stage)
        raise
    if proc.wait() != 0:
        raise RuntimeError(f"stage '{stage}' failed (exit {proc.returncode}):\n" + "\n".join(tail))


def _stop_interrupted(proc: subprocess.Popen, stage: str, wait_s: float = 30.0) -> None:
    """After a Ctrl-C: let the stage end as interrupted (its resume states stay for the
    next run), then make sure it is gone.

    A terminal's Ctrl-C has reached DVC and the stage already (one process group); a
    SIGINT sent to this process alone is passed on. A stage that has not exited within
    `wait_s` is killed.
    """
    log.warning("[%s] interrupted: stopping the stage", stage)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _follow(proc: subprocess.Popen, stage: str) -> list[str]:
    """Pass the stage's output on until it ends (see `repro`); returns its last 20 lines."""
    tail: list[str] = []
    last_progress = 0.0
    assert proc.stdout is not None
    for line in proc.stdout:
        # tqdm redraws with carriage returns; keep the last state of the line.
        line = line.rstrip().split("\r")[-1]
        if not line:
            continue
        tail = (tail + [line])[-20:]
        bar = parse_tqdm(line)
        if bar is not None:
            stage_progress(bar)
            # Progress bars redraw many times a second: one line every few seconds is enough for the log.
            if time.monotonic() - last_progress < PROGRESS_EVERY_S:
                continue
            last_progress = time.monotonic()
        # The stage's own warnings ("resuming from the state saved after step N") are
        # for the user: passed on as warnings, so the quiet console shows them.
        ours = STAGE_WARNING.match(line)
        if ours:
            log.warning("[%s] %s", stage, ours.group(1))
        else:
            log.info("[%s] %s", stage, line)
    return tail


def lock_entry(root: Path, stage: str) -> dict[str, Any]:
    """The stage's record in dvc.lock: `{"deps": {path: md5}, "outs": {path: md5}, "params": {...}}`."""
    lock_path = root / "dvc.lock"
    if not lock_path.exists():
        return {"deps": {}, "outs": {}, "params": {}}
    entry = (yaml.safe_load(lock_path.read_text()) or {}).get("stages", {}).get(stage, {})
    return {
        "deps": {d["path"]: d.get("md5") for d in entry.get("deps", [])},
        "outs": {o["path"]: o.get("md5") for o in entry.get("outs", [])},
        "params": entry.get("params", {}),
    }


def lineage_tags(root: Path, stage: str) -> dict[str, str]:
    """MLflow tags naming the DVC hashes of a stage's inputs and outputs."""
    entry = lock_entry(root, stage)
    tags = {f"dvc.dep.{path}": str(md5) for path, md5 in entry["deps"].items()}
    tags.update({f"dvc.out.{path}": str(md5) for path, md5 in entry["outs"].items()})
    return tags
