"""Honest run states (no run shown as running after its process died): what a dead `gr2 run` leaves
behind is found and closed by the next one.

- MLflow runs left RUNNING by a process that is gone end as KILLED; runs whose
  owner still runs, runs of another host or workspace, and runs that name no
  owner are left alone.
- Prefect's temporary API dies with the command that started it (watchdog), and
  an orphan left by a dead command is stopped by the next one (record).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.tracking import owner_tags, owners_alive, process_alive, process_start


@pytest.fixture
def own_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A file MLflow store in tmp_path for this test only. A process-wide tracking URI
    (set once anything in this session called `mlflow.set_tracking_uri`) wins over the
    environment, so that global is swapped too and restored as it was, unset included;
    else these runs land in the smoke workspace's store and skew its run counts."""
    from mlflow.tracking._tracking_service import utils

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the fast file store; the code path is the same
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(utils, "_tracking_uri", uri)
    return uri


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_process_liveness_tells_live_dead_reused_and_zombie() -> None:
    me = os.getpid()
    assert process_alive(me) and process_alive(me, process_start(me))
    assert not process_alive(_dead_pid())
    # The same pid with another start time is another process (pid reuse).
    assert not process_alive(me, str(int(process_start(me) or 0) + 1))
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while process_start(zombie.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_start(zombie.pid) is None, "an exited, unreaped child (zombie) counts as gone"
    zombie.wait()


def test_owner_tags_name_this_process_and_host(tmp_path: Path) -> None:
    tags = owner_tags(tmp_path)
    assert tags["gr2.pid"] == str(os.getpid()) and tags["gr2.root"] == str(tmp_path.resolve())
    assert owners_alive(tags) is True
    assert owners_alive({**tags, "gr2.pid": str(_dead_pid()), "gr2.pid_start": ""}) is False
    # Either owner alive is enough: a stage process can outlive the flow that started it.
    stage = owner_tags(tmp_path, "gr2.stage_")
    assert set(stage) == {"gr2.stage_pid", "gr2.stage_pid_start"}
    assert owners_alive({**tags, "gr2.pid": str(_dead_pid()), **stage}) is True
    assert owners_alive({**tags, "gr2.host": "elsewhere"}) is None
    assert owners_alive({"gr2.host": tags["gr2.host"]}) is None


def test_stale_running_runs_are_killed_and_live_ones_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, own_store: str
) -> None:
    from mlflow import MlflowClient

    from tasks.tracking import close_stale_runs, experiment_id

    monkeypatch.setenv("GR2_ROOT", str(tmp_path))
    client = MlflowClient()
    exp = experiment_id(tmp_path)
    mine = owner_tags(tmp_path)
    dead = {**mine, "gr2.pid": str(_dead_pid()), "gr2.pid_start": ""}

    def run(name: str, tags: dict[str, str]) -> str:
        return client.create_run(exp, run_name=name, tags=tags).info.run_id

    killed_stage = run("sft", {**dead, "gr2.stage": "sft"})
    killed_parent = run("pipeline", dead)
    live = run("live", mine)
    stage_outlived_flow = run("cft", {**dead, "gr2.stage": "cft", **owner_tags(tmp_path, "gr2.stage_")})
    other_host = run("other-host", {**dead, "gr2.host": "another-machine"})
    other_ws = run("other-ws", {**dead, "gr2.root": str(tmp_path / "elsewhere")})
    untagged = run("untagged", {})
    finished = run("finished", dead)
    client.set_terminated(finished, "FINISHED")

    with caplog.at_level(logging.WARNING, logger="tasks.tracking"):
        closed = close_stale_runs(tmp_path, client)
    assert sorted(closed) == sorted([killed_stage, killed_parent])
    status = {r: client.get_run(r).info.status for r in (killed_stage, killed_parent, live, stage_outlived_flow, other_host, other_ws, untagged, finished)}
    assert status == {
        killed_stage: "KILLED",
        killed_parent: "KILLED",
        live: "RUNNING",
        stage_outlived_flow: "RUNNING",
        other_host: "RUNNING",
        other_ws: "RUNNING",
        untagged: "RUNNING",
        finished: "FINISHED",
    }
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # one line per closed run, naming it
    assert any(killed_stage in line and "(sft," in line and f"pid {dead['gr2.pid']}" in line and "KILLED" in line for line in lines)
    assert close_stale_runs(tmp_path, client) == []  # idempotent


# --- Prefect's temporary API ------------------------------------------------------------------

_FAKE_SERVER = f"import time; time.sleep(120)  # {'prefect.server.api.server:create_app'}"


def _record(root: Path, owner: int, server: subprocess.Popen) -> Path:
    from flows.prefect_api import STATE_DIR

    path = root / STATE_DIR / f"{owner}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"owner_pid": owner, "owner_start": "", "server_pid": server.pid, "server_start": process_start(server.pid), "url": "http://127.0.0.1:1"}))
    return path


def test_orphan_api_of_a_dead_command_is_stopped(tmp_path: Path) -> None:
    from flows.prefect_api import stop_orphan_apis

    # Stand-ins for uvicorn: the check reads the server's mark from its command line.
    orphan = subprocess.Popen([sys.executable, "-c", _FAKE_SERVER])
    owned = subprocess.Popen([sys.executable, "-c", _FAKE_SERVER])
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        orphan_rec = _record(tmp_path, _dead_pid(), orphan)
        owned_rec = _record(tmp_path, os.getpid(), owned)
        stranger_rec = _record(tmp_path, _dead_pid(), stranger)  # the pid now runs something else: never signalled
        (tmp_path / ".gr2/prefect-api/garbage.json").write_text("{not json")
        assert stop_orphan_apis(tmp_path) == [orphan.pid]
        assert orphan.wait(timeout=15) == -signal.SIGTERM
        assert owned.poll() is None and stranger.poll() is None
        assert not orphan_rec.exists() and not stranger_rec.exists() and owned_rec.exists()
        assert not (tmp_path / ".gr2/prefect-api/garbage.json").exists()
    finally:
        for p in (orphan, owned, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()


_GR2_RUN_STAND_IN = """
import sys, time
from pathlib import Path
from flows.prefect_api import temporary_api
with temporary_api(Path(sys.argv[1])) as url:
    from prefect.server.api.server import SubprocessASGIServer
    print(SubprocessASGIServer().server_process.pid, url, flush=True)
    time.sleep(300)
"""


@pytest.mark.integration
def test_temporary_api_dies_with_a_sigkilled_parent(tmp_path: Path) -> None:
    """A command holding the temporary API is SIGKILLed: the watchdog stops the server, then the record is cleared."""
    from flows.prefect_api import STATE_DIR, stop_orphan_apis

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parent = subprocess.Popen([sys.executable, "-c", _GR2_RUN_STAND_IN, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    server_pid = None
    try:
        line = parent.stdout.readline()  # once the server answers (about 10 s, more under load)
        assert line, f"the stand-in exited with {parent.wait()}"
        server_pid = int(line.split()[0])
        assert process_start(server_pid) is not None
        assert len(list((tmp_path / STATE_DIR).glob("*.json"))) == 1
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while process_start(server_pid) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert process_start(server_pid) is None, "the temporary API outlived its SIGKILLed parent"
        assert stop_orphan_apis(tmp_path) == []  # nothing left to stop; the stale record goes
        assert not list((tmp_path / STATE_DIR).glob("*.json"))
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if server_pid and process_start(server_pid) is not None:
            os.kill(server_pid, signal.SIGKILL)


@pytest.mark.integration
def test_flow_run_of_a_killed_pipeline_is_marked_crashed(tmp_path: Path, prefect_harness, own_store: str) -> None:
    from mlflow import MlflowClient
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from flows.pipeline import _mark_flow_runs_crashed
    from tasks.tracking import close_stale_runs, experiment_id

    @flow(name="gr2-pipeline-stand-in")
    def stand_in() -> None:
        pass

    with get_client(sync_client=True) as prefect:
        fr = prefect.create_flow_run(stand_in, state=Running())
        done = prefect.create_flow_run(stand_in, state=Running())
    client = MlflowClient()
    dead = {**owner_tags(tmp_path), "gr2.pid": str(_dead_pid()), "gr2.pid_start": ""}
    exp = experiment_id(tmp_path)
    parent = client.create_run(exp, run_name="pipeline", tags={**dead, "prefect.flow_run_id": str(fr.id)}).info.run_id
    stage = client.create_run(exp, run_name="sft", tags={**dead, "gr2.stage": "sft", "prefect.flow_run_id": str(done.id)}).info.run_id
    closed = close_stale_runs(tmp_path, client)
    assert sorted(closed) == sorted([parent, stage])
    _mark_flow_runs_crashed(client, closed, logging.getLogger("test"))
    with get_client(sync_client=True) as prefect:
        assert prefect.read_flow_run(fr.id).state.type.value == "CRASHED"
        # Only the pipeline's own run stands for its flow run; a stage run's id is not touched.
        assert prefect.read_flow_run(done.id).state.type.value == "RUNNING"
