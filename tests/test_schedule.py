"""Scheduled retraining: the params section, data snapshots, and a real scheduled run.

The scheduled run is the documented command, `gr2 schedule serve`, started as a
process: it starts a Prefect server on a free loopback port, deploys
`gr2-retrain` with a short interval on a copy of the smoke workspace (new data
appended to its source folder, promotion gates loosened so the smoke models can
pass), and the test waits for one scheduled run to complete, checks what it
changed (a new data snapshot committed and pushed, only `prepare` rerun,
`champion` aliases set by the gates), then stops the command by its process id
and checks the server it started is gone too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.schedule import ScheduleConfig, free_port, load_schedule_config
from flows.snapshot import SnapshotError, pointer_md5, snapshot_data
from tasks.common import ParamsError

ROOT = Path(__file__).resolve().parents[1]
GR2 = str(Path(sys.executable).parent / "gr2")


def test_schedule_params_section() -> None:
    cfg = load_schedule_config(ROOT)
    assert cfg.cron.count(" ") == 4 and cfg.promote == ["gr2", "diffusion-gr2", "spec-gr2"]
    assert cfg.commit and cfg.push


def test_schedule_params_errors_name_the_field(tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text("schedule:\n  cron: '0 4 * * 1'\n  crn: typo\n")
    with pytest.raises(ParamsError, match="schedule.crn"):
        load_schedule_config(tmp_path)
    (tmp_path / "params.yaml").write_text("prepare: {}\n")
    assert load_schedule_config(tmp_path) == ScheduleConfig()


def _project(tmp_path: Path, data_dir: str) -> Path:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "params.yaml").write_text(yaml.safe_dump({"prepare": {"data_dir": data_dir}}))
    (root / ".gitignore").write_text("/data/\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def test_snapshot_refuses_folders_git_cannot_track(tmp_path: Path) -> None:
    src = tmp_path / "incoming"
    src.mkdir()
    root = _project(tmp_path, "data/raw")
    with pytest.raises(SnapshotError, match="ignored by git"):
        snapshot_data(root, src)
    (root / "params.yaml").write_text(yaml.safe_dump({"prepare": {"data_dir": str(src)}}))
    with pytest.raises(SnapshotError, match="outside the project"):
        snapshot_data(root, src)
    (root / "params.yaml").write_text(yaml.safe_dump({"prepare": {"data_dir": "raw"}}))
    with pytest.raises(SnapshotError, match="does not exist"):
        snapshot_data(root, tmp_path / "nowhere")


@pytest.mark.integration
def test_snapshot_versions_new_content_only(tmp_path: Path) -> None:
    """A snapshot is committed and pushed when the content changed; an identical one changes nothing."""
    from flows.snapshot import add_default_remote, dvc, git

    src = tmp_path / "incoming"
    src.mkdir()
    (src / "a.txt").write_text("1 2 3\n")
    root = _project(tmp_path, "raw")
    dvc(root, "init", "-q")
    add_default_remote(root, str(tmp_path / "remote"))
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "init")

    first = snapshot_data(root, src)
    assert first["changed"] and first["previous"] is None and first["commit"] and first["pushed"]
    assert (root / "raw" / "a.txt").read_text() == "1 2 3\n"
    assert pointer_md5(root / "raw.dvc") == first["md5"]
    assert git(root, "status", "--porcelain", "--untracked-files=no").stdout == ""  # pointer committed: a clean tree

    again = snapshot_data(root, src)
    assert not again["changed"] and again["commit"] is None and again["md5"] == first["md5"]

    (src / "a.txt").write_text("1 2 3\n4 5\n")
    (src / "b.txt").write_text("new file\n")
    third = snapshot_data(root, src)
    assert third["changed"] and third["previous"] == first["md5"] and third["commit"] != first["commit"]
    assert sorted(p.name for p in (root / "raw").iterdir()) == ["a.txt", "b.txt"]
    # the new snapshot is in the remote: a fresh clone of the pointer restores it by hash
    md5 = third["md5"].removesuffix(".dir")
    assert (tmp_path / "remote" / "files" / "md5" / md5[:2] / (md5[2:] + ".dir")).exists()
    assert "data snapshot raw" in git(root, "log", "-1", "--format=%s").stdout


# ---------------------------------------------------------------------------
# A real scheduled run


def _copy_workspace(ws: Path, dest: Path) -> Path:
    """A copy of the smoke workspace whose MLflow store writes its new artifacts into the copy."""
    shutil.copytree(ws, dest, symlinks=True)  # its DVC remote (dest/dvc-remote) comes along: .dvc/config names it relatively
    con = sqlite3.connect(dest / "mlflow.db")
    with con:
        con.execute("UPDATE experiments SET artifact_location = replace(artifact_location, ?, ?)", (str(ws), str(dest)))
    con.close()
    subprocess.run(["git", "worktree", "prune"], cwd=dest, check=True)
    return dest


def _api(url: str, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.integration
def test_scheduled_run_retrains_and_promotes(smoke_run: dict[str, Any], tmp_path: Path) -> None:
    from mlflow import MlflowClient

    ws = _copy_workspace(smoke_run["ws"], tmp_path / "ws")
    # New interactions arrive: users appended to the source folder. The smoke
    # profile reads the first 1,500 users, so the snapshot changes, `prepare`
    # reruns, its output does not, and nothing after it reruns.
    source = tmp_path / "incoming"
    shutil.copytree(yaml.safe_load((ws / "params.yaml").read_text())["schedule"]["source"], source, copy_function=shutil.copyfile)
    with open(source / "Beauty.txt", "a") as fh:
        fh.write("99001 1 2 3 4\n99002 5 6 7\n")
    params = yaml.safe_load((ws / "params.yaml").read_text())
    params["schedule"]["source"] = str(source)
    for gates in params["promote"]["models"].values():  # the smoke models write no valid answers
        gates["min_valid_permutation"] = 0.0
        if gates.get("speed"):
            gates["speed"]["min_speedup"] = 0.0
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "retrain from incoming/"], cwd=ws, check=True)
    snapshot_before = pointer_md5(ws / "raw.dvc")
    store = f"sqlite:///{ws / 'mlflow.db'}"
    client = MlflowClient(store, store)
    versions_before = {m: len(client.search_model_versions(f"name = '{m}'")) for m in ("gr2", "diffusion-gr2")}
    for model in versions_before:  # another test may have promoted in the original workspace
        if "champion" in client.get_registered_model(model).aliases:
            client.delete_registered_model_alias(model, "champion")

    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        "MLFLOW_TRACKING_URI": store,
        "GR2_TRACKING": "on",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    for key in ("PREFECT_API_URL", "PREFECT_PROFILES_PATH", "GR2_ROOT"):
        env.pop(key, None)
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [GR2, "--root", str(ws), "schedule", "serve", "--interval", "10", "--port", str(port)],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: everything it starts can be stopped by its id
        )
    server_pid = None
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while server_pid is None:
            text = log_path.read_text(errors="replace")
            if "started a Prefect server (pid " in text:
                server_pid = int(text.split("started a Prefect server (pid ", 1)[1].split(")", 1)[0])
            assert proc.poll() is None, f"gr2 schedule serve exited:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"no server after 120 s:\n{text[-3000:]}"
            time.sleep(0.5)
        assert f"at {api}" in log_path.read_text()

        # One scheduled run of the deployment completes.
        deadline = time.monotonic() + 300
        done = None
        while done is None:
            runs = _api(api, "/flow_runs/filter", {"flow_runs": {"state": {"type": {"any_": ["COMPLETED", "FAILED", "CRASHED"]}}}})
            finished = [r for r in runs if r.get("deployment_id")]
            if finished:
                done = finished[0]
                break
            assert proc.poll() is None, f"gr2 schedule serve exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no scheduled run finished in 300 s:\n{log_path.read_text()[-4000:]}"
            time.sleep(2)
        assert done["state"]["type"] == "COMPLETED", f"{done['state']}\n{log_path.read_text()[-4000:]}"
        assert done["auto_scheduled"] is True, "the run came from the schedule"
        run_id = done["id"]
        arts = _api(api, "/artifacts/filter", {"artifacts": {"key": {"any_": ["gr2-retrain"]}}})
        assert any(a["flow_run_id"] == run_id and "prepare" in a["data"] for a in arts)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the documented stop: graceful runner shutdown, then the server it started
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # Anything left in the command's process group (a cancelled run's stage) is stopped by that group's id.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if server_pid and _alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
            pytest.fail(f"the Prefect server (pid {server_pid}) outlived gr2 schedule serve")
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    assert not _alive(server_pid)

    # What the run changed: a new snapshot, committed and pushed ...
    snapshot_after = pointer_md5(ws / "raw.dvc")
    assert snapshot_after != snapshot_before
    assert (ws / "raw" / "Beauty.txt").read_text().endswith("99002 5 6 7\n")
    head = subprocess.run(["git", "log", "-1", "--format=%s"], cwd=ws, capture_output=True, text=True, check=True).stdout
    assert head.startswith("data snapshot raw " + snapshot_after)
    md5 = snapshot_after.removesuffix(".dir")
    assert (ws / "dvc-remote" / "files" / "md5" / md5[:2] / (md5[2:] + ".dir")).exists()
    # ... only prepare reran (its output did not change, so nothing after it did) ...
    exp = client.get_experiment_by_name("diffusion-gr2")
    stage_runs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("prefect.flow_run_id")]
    pipeline_runs = [r for r in stage_runs if r.info.run_name == "pipeline"]
    assert len(pipeline_runs) == 3  # the fixture's two and the scheduled one
    newest = max(pipeline_runs, key=lambda r: r.info.start_time)
    reran = sorted(r.info.run_name for r in stage_runs if r.data.tags.get("mlflow.parentRunId") == newest.info.run_id)
    assert reran == ["prepare"]
    # ... no new versions, and the gates moved champion to the challengers, recording this run.
    assert {m: len(client.search_model_versions(f"name = '{m}'")) for m in versions_before} == versions_before
    for model in ("gr2", "diffusion-gr2"):
        champion = client.get_model_version_by_alias(model, "champion")
        assert champion.version == client.get_model_version_by_alias(model, "challenger").version
        assert champion.tags["promotion.decision"] == "promoted"
        assert champion.tags["promotion.prefect_flow_run_id"] == run_id
