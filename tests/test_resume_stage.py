"""Resumable stages (a killed stage loses at most the steps since its last saved state), through the
real stage entry point: `python -m tasks.sft`
and `python -m tasks.retrieve` killed with SIGKILL right after a saved state resume on
rerun, say so, end with the checkpoint and metrics of an uninterrupted run, and remove
their states; a rerun with other params or inputs starts fresh and says why."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from gr2model.data.dataset import Dataset, leave_one_out, save_prepared
from tasks.common import RESUME_DIR, ResumeConfig, StageResume

from test_sasrec import N_ITEMS, random_sequences
from tiny import write_toy_stage_inputs

ROOT = Path(__file__).resolve().parents[1]
SFT_PARAMS = {
    "seed": 0, "valid_fraction": 0.2, "max_examples": 0,
    "train": {"epochs": 3, "batch_size": 4, "lr": 0.002, "warmup_steps": 2, "seed": 3},
}


def sft_workspace(path: Path) -> Path:
    """A workspace holding what `tasks.sft` reads: kept traces, a gr2-base checkpoint, params, dvc.yaml."""
    write_toy_stage_inputs(path, "data/traces/train.parquet", "kept", "checkpoints/gr2-base", "midtrain")
    (path / "params.yaml").write_text(
        yaml.safe_dump({"sft": SFT_PARAMS, "resume": {"every_steps": 2, "every_minutes": 0}})
    )
    (path / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": {"sft": {"cmd": "python -m tasks.sft", "deps": ["data/traces", "checkpoints/gr2-base"]}}})
    )
    return path


def run_stage(ws: Path, kill_after_saves: int, stage: str = "sft", loop: str = "") -> subprocess.CompletedProcess:
    """The stage in its workspace, killed after `loop`'s (any loop's) kill_after_saves-th save."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GR2_TRACKING": "off"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "stage_worker.py"), stage, str(kill_after_saves),
         *([loop] if loop else [])],
        cwd=ws, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.integration  # runs the sft stage as a process, twice
def test_killed_sft_stage_resumes_and_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    killed_ws = sft_workspace(tmp_path / "killed")
    clean_ws = tmp_path / "clean"
    shutil.copytree(killed_ws, clean_ws)

    # 24 traces, 4 held out: 20 / 4 = 5 batches x 3 epochs = 15 steps; the 3rd save is step 6.
    killed = run_stage(killed_ws, kill_after_saves=3)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (killed_ws / "checkpoints/gr2-sft").exists() and not (killed_ws / "metrics/sft.json").exists()
    states = list((killed_ws / RESUME_DIR / "sft").glob("*/train/step-*"))
    assert [p.name for p in states] == ["step-000000006"]

    resumed = run_stage(killed_ws, kill_after_saves=0)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from the state saved after step 6" in resumed.stderr
    assert "sft finished after resuming (train from step 6)" in resumed.stderr
    assert not (killed_ws / RESUME_DIR / "sft").exists()  # removed once the outputs are written

    clean = run_stage(clean_ws, kill_after_saves=0)
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert "resuming" not in clean.stderr
    for name in ("model.safetensors", "config.json"):
        got = (killed_ws / "checkpoints/gr2-sft" / name).read_bytes()
        assert got == (clean_ws / "checkpoints/gr2-sft" / name).read_bytes(), name
    timings = ("seconds", "train_s")
    m1, m2 = (json.loads((ws / "metrics/sft.json").read_text()) for ws in (killed_ws, clean_ws))
    assert {k: v for k, v in m1.items() if k not in timings} == {k: v for k, v in m2.items() if k not in timings}
    assert m1["steps"] == 15


RETRIEVE_PARAMS = {
    "seed": 0, "k": 5, "crossfit_folds": 2, "ensemble_grid": [0.0, 1.0], "eval_chunk_size": 64,
    "sasrec": {"max_len": 8, "hidden": 16, "heads": 2, "layers": 1, "dropout": 0.1},
    "train": {"epochs": 8, "batch_size": 16, "lr": 0.01, "patience": 2, "max_valid_users": 0},
}


def retrieve_workspace(path: Path) -> Path:
    """A workspace holding what `tasks.retrieve` reads: a prepared data set of 120 users
    (random sequences, so validation NDCG stops improving and early stopping ends the
    final model's run), params, dvc.yaml."""
    seqs = random_sequences(120, seed=11)
    sequences = pl.DataFrame(
        {"user_id": list(range(1, len(seqs) + 1)), "items": seqs},
        schema={"user_id": pl.Int64, "items": pl.List(pl.Int64)},
    )
    items = pl.DataFrame(
        {"item_id": list(range(1, N_ITEMS + 1)), "sid": [None] * N_ITEMS, "attributes": [[] for _ in range(N_ITEMS)]},
        schema={"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)},
    )
    save_prepared(Dataset(sequences, items), leave_one_out(sequences), path / "data/prepared")
    (path / "params.yaml").write_text(
        yaml.safe_dump({"retrieve": RETRIEVE_PARAMS, "resume": {"every_steps": 3, "every_minutes": 0}})
    )
    (path / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": {"retrieve": {"cmd": "python -m tasks.retrieve", "deps": ["data/prepared"]}}})
    )
    return path


@pytest.mark.slow  # ~25 s; the sft stage's resume above runs by default
def test_killed_retrieve_stage_resumes_each_sasrec_run_and_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    """retrieve trains SASRec three times (the final model, then one per cross-fit fold),
    each a loop with its own states. Killed right after the first save of fold 1 (mid
    epoch 1), the rerun restores the finished `sasrec` and `fold0` runs without training
    them, resumes `fold1` from step 3, and writes the outputs of an uninterrupted run."""
    killed_ws = retrieve_workspace(tmp_path / "killed")
    clean_ws = tmp_path / "clean"
    shutil.copytree(killed_ws, clean_ws)

    killed = run_stage(killed_ws, kill_after_saves=1, stage="retrieve", loop="fold1")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (killed_ws / "checkpoints/retriever").exists() and not (killed_ws / "metrics/retrieve.json").exists()
    (key,) = (killed_ws / RESUME_DIR / "retrieve").iterdir()
    states = {p.parent.name: p.name for p in key.glob("*/step-*")}
    assert set(states) == {"sasrec", "fold0", "fold1"} and states["fold1"] == "step-000000003"

    resumed = run_stage(killed_ws, kill_after_saves=0, stage="retrieve")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from the state saved after step 3" in resumed.stderr
    finished = {name: int(step.removeprefix("step-")) for name, step in states.items()}
    assert (
        f"retrieve finished after resuming (sasrec from step {finished['sasrec']}, "
        f"fold0 from step {finished['fold0']}, fold1 from step 3)"
    ) in resumed.stderr
    # The final model (the one run with validation) was restored, not trained again.
    assert "early stop at epoch" not in resumed.stderr
    assert not (killed_ws / RESUME_DIR / "retrieve").exists()

    clean = run_stage(clean_ws, kill_after_saves=0, stage="retrieve")
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert "resuming" not in clean.stderr and "early stop at epoch" in clean.stderr
    ckpt = Path("checkpoints/retriever")
    for path in sorted(p.relative_to(clean_ws / ckpt) for p in (clean_ws / ckpt).rglob("*") if p.is_file()):
        assert (killed_ws / ckpt / path).read_bytes() == (clean_ws / ckpt / path).read_bytes(), path
    for name in ("train", "valid", "test"):
        got, want = (pl.read_parquet(ws / f"data/candidates/{name}.parquet") for ws in (killed_ws, clean_ws))
        assert got.equals(want), name
    m1, m2 = (json.loads((ws / "metrics/retrieve.json").read_text()) for ws in (killed_ws, clean_ws))
    timing = [k for k in m2 if k == "seconds" or k.endswith("_s")]
    assert {k: v for k, v in m1.items() if k not in timing} == {k: v for k, v in m2.items() if k not in timing}


def _fake_state(resume: StageResume) -> Path:
    state = resume.folder / "train" / "step-000000004"
    state.mkdir(parents=True)
    return state


def test_other_params_or_inputs_start_fresh_and_say_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ws = tmp_path
    (ws / "data").mkdir()
    (ws / "data/a.txt").write_text("one")
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"sft": {"deps": ["data", "missing.py"]}}}))
    log = logging.getLogger("test.resume")
    cfg = ResumeConfig(every_steps=2, every_minutes=0)
    params = {"seed": 0, "train": {"lr": 0.002, "epochs": 3}}

    first = StageResume(ws, "sft", params, cfg, log)
    assert first.manifest["inputs"]["missing.py"] == "missing"
    state = _fake_state(first)
    same = StageResume(ws, "sft", params, cfg, log)
    assert same.key == first.key and state.exists()  # same params and inputs: kept for the loop to resume

    with caplog.at_level(logging.WARNING):
        other = StageResume(ws, "sft", {**params, "train": {"lr": 0.001, "epochs": 3}}, cfg, log)
    assert other.key != first.key and not first.folder.exists()
    assert "params changed: train.lr; starting fresh" in caplog.text

    _fake_state(other)
    (ws / "data/a.txt").write_text("two")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        StageResume(ws, "sft", {**params, "train": {"lr": 0.001, "epochs": 3}}, cfg, log)
    assert "inputs changed: data; starting fresh" in caplog.text and not other.folder.exists()


def test_resume_off_gives_no_checkpointer(tmp_path: Path) -> None:
    off = StageResume(tmp_path, "sft", {}, ResumeConfig(every_steps=0, every_minutes=0), logging.getLogger("t"))
    assert off.checkpointer() is None and off.resumed() == {}
    on = StageResume(tmp_path, "sft", {}, ResumeConfig(every_steps=0, every_minutes=5), logging.getLogger("t"))
    ckpt = on.checkpointer("fold1")
    assert ckpt is not None and ckpt.every_seconds == 300 and ckpt.directory == on.folder / "fold1"
    on.clear()
    assert not (tmp_path / RESUME_DIR / "sft").exists()
