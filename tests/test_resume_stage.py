"""Resumable stages (issue 16), through the real stage entry point: `python -m tasks.sft`
killed with SIGKILL right after a saved state resumes on rerun, says so, ends with the
checkpoint and metrics of an uninterrupted run, and removes its states; a rerun with other
params or inputs starts fresh and says why."""

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

from gr2model.checkpoint import save_hf_checkpoint
from tasks.common import RESUME_DIR, ResumeConfig, StageResume

from tiny import toy_examples, toy_items, toy_model, toy_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SFT_PARAMS = {
    "seed": 0, "valid_fraction": 0.2, "max_examples": 0,
    "train": {"epochs": 3, "batch_size": 4, "lr": 0.002, "warmup_steps": 2, "seed": 3},
}


def sft_workspace(path: Path) -> Path:
    """A workspace holding what `tasks.sft` reads: kept traces, a gr2-base checkpoint, params, dvc.yaml."""
    tok, items = toy_tokenizer(), toy_items()
    examples = toy_examples(items)
    (path / "data/traces").mkdir(parents=True)
    pl.DataFrame(
        {"prompt": [p for p, _ in examples], "response": [r for _, r in examples], "kept": [True] * len(examples)}
    ).write_parquet(path / "data/traces/train.parquet")
    save_hf_checkpoint(path / "checkpoints/gr2-base", toy_model(tok), tok, {"stage": "midtrain"})
    (path / "params.yaml").write_text(
        yaml.safe_dump({"sft": SFT_PARAMS, "resume": {"every_steps": 2, "every_minutes": 0}})
    )
    (path / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": {"sft": {"cmd": "python -m tasks.sft", "deps": ["data/traces", "checkpoints/gr2-base"]}}})
    )
    return path


def run_stage(ws: Path, kill_after_saves: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GR2_TRACKING": "off"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "resume_worker.py"), "stage", "sft", str(kill_after_saves)],
        cwd=ws, env=env, capture_output=True, text=True, timeout=300,
    )


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
