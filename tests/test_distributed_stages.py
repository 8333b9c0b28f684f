"""Stages under a launcher (so a stage runs on several processes or GPUs as it does on one),
through the stage command, on CPU processes (gloo).

`GR2_LAUNCH="accelerate launch --multi_gpu --num_processes 2" python -m tasks.<stage>`
(the command dvc.yaml runs, with the launcher from the environment) against plain
`python -m tasks.<stage>` in a copy of the same workspace:

- `sft` (slow): the checkpoint's weights agree to 1e-5 (measured max difference 4.4e-7
  after 15 steps: two processes sum the gradient in another order, and each
  part of a global batch is padded to its own longest example) and every
  non-timing metric to 1e-5 relative;
- `trajectories`: `data/trajectories/train.parquet` is byte-identical (each batch
  holds the same rows with the same padding on either run, `lm_rerank(state=)`);
- `cft` and `ar_rl` (slow): weights to 1e-5 and metrics to 1e-5 relative, as `sft`
  (`ar_rl`: per-row sampling streams and one shuffle over all processes' rollouts).

Each launch takes ~15 s on a loaded 2-core machine (two interpreters, torchrun, gloo).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml
from safetensors.torch import load_file

from gr2model.models.checkpoint import save_hf_checkpoint
from gr2model.data.dataset import Dataset, leave_one_out, save_prepared
from gr2model.task.rerank_format import FormatConfig
from tasks.common import launch_argv, requested_processes
from tasks.trajectories import TrajectoriesConfig

from test_resume_stage import sft_workspace
from tiny import TOY, items_table, tiny_model, toy_tokenizer, write_toy_stage_inputs

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"seconds", "train_s", "decode_s", "tokens_per_s"}


def free_port() -> int:
    """A port for torchrun's rendezvous: its default (29500) may be taken by another run on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_stage(ws: Path, stage: str, processes: int) -> subprocess.CompletedProcess:
    """`python -m tasks.<stage>` in `ws`, under `GR2_LAUNCH` for more than one process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GR2_TRACKING": "off"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("GR2_LAUNCH", None)
    if processes > 1:
        env["GR2_LAUNCH"] = f"accelerate launch --multi_gpu --num_processes {processes} --main_process_port {free_port()}"
    proc = subprocess.run([sys.executable, "-m", f"tasks.{stage}"], cwd=ws, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_on_one_and_two(one: Path, stage: str) -> Path:
    """Copy workspace `one` to a sibling `two`, run `stage` in `one` on one process and in `two`
    on two (checking that it really ran on two); returns `two`."""
    two = one.parent / "two"
    shutil.copytree(one, two)
    run_stage(one, stage, 1)
    assert f"{stage} on 2 processes (MULTI_CPU)" in run_stage(two, stage, 2).stderr
    return two


def same_weights_and_metrics(one: Path, two: Path, checkpoint: str, stage: str, abs_tol: float = 1e-12) -> tuple[dict, dict]:
    """Assert that workspaces `one` and `two` hold the same `checkpoint` (every weight within
    1e-5) and the same `metrics/<stage>.json` (every non-timing number within 1e-5 relative,
    or `abs_tol`); returns both metrics (`results`)."""
    a = load_file(one / checkpoint / "model.safetensors")
    b = load_file(two / checkpoint / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-5) for k in a), max((a[k] - b[k]).abs().max().item() for k in a)
    ra, rb = results(one / f"metrics/{stage}.json"), results(two / f"metrics/{stage}.json")
    assert rb == {k: pytest.approx(v, rel=1e-5, abs=abs_tol) for k, v in ra.items()}
    return ra, rb


def results(metrics_file: Path) -> dict[str, float]:
    """The non-timing leaves of a stage's metrics file."""

    def leaves(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {} if k in TIMING else {f"{prefix}{k}": v})
        return out

    return leaves(json.loads(metrics_file.read_text()))


def no_leftovers(ws: Path) -> None:
    """No temporary folder or file of an atomic write is left (a second writer would race on them)."""
    left = [p for p in ws.rglob(".*") if p.name != ".gr2" and ".gr2" not in p.parts]
    assert not left, left


@pytest.mark.slow  # ~35 s; the library's two-process SFT test (tests/test_sft.py) and the trajectories stage's launch run by default
def test_sft_stage_on_two_processes_equals_one_process(tmp_path: Path) -> None:
    one = sft_workspace(tmp_path / "one")
    two = run_on_one_and_two(one, "sft")
    ra, rb = same_weights_and_metrics(one, two, "checkpoints/gr2-sft", "sft")
    assert ra.keys() == rb.keys() and ra["steps"] == rb["steps"] == 15  # 20 traces in batches of 4 (global), 3 epochs
    assert not (two / ".gr2/resume/sft").exists()  # the main process removed the saved states
    no_leftovers(two)


def trajectories_workspace(path: Path) -> Path:
    """What `tasks.trajectories` reads: prepared items, the prompt format, training candidate lists
    (12 re-ranking examples, 2 without the target), a randomized GR2 checkpoint, params."""
    items = items_table()
    rng = torch.Generator().manual_seed(5)
    seqs = [torch.randint(1, 5, (int(torch.randint(3, 7, (1,), generator=rng)),), generator=rng).tolist() for _ in range(14)]
    sequences = pl.DataFrame({"user_id": list(range(1, 15)), "items": seqs}, schema={"user_id": pl.Int64, "items": pl.List(pl.Int64)})
    save_prepared(Dataset(sequences, items), leave_one_out(sequences), path / "data/prepared")
    fmt = FormatConfig(history_len=3, with_attributes=False)
    (path / "data/traces").mkdir(parents=True)
    (path / "data/traces/format.json").write_text(json.dumps(asdict(fmt)))
    rows = []
    for u, s in enumerate(seqs, start=1):
        others = [i for i in torch.randperm(4, generator=rng).add(1).tolist() if i != s[-3]]
        cands = others if u <= 2 else [others[k] if k != u % 3 else s[-3] for k in range(3)]
        rows.append({"user_id": u, "position": len(s) - 3, "history": s[:-3], "candidates": cands, "target": s[-3],
                     "target_rank": cands.index(s[-3]) if s[-3] in cands else -1})  # fmt: skip
    (path / "data/candidates").mkdir(parents=True)
    pl.DataFrame(rows).write_parquet(path / "data/candidates/train.parquet")
    tok = toy_tokenizer()
    save_hf_checkpoint(path / "checkpoints/gr2", tiny_model(tok, seed=2, scale=0.3, config=TOY), tok, {"stage": "ar_rl"})
    (path / "params.yaml").write_text(yaml.safe_dump({"trajectories": TrajectoriesConfig(batch_size=3, max_new_tokens=16).model_dump()}))
    return path


@pytest.mark.integration  # launches the stage on one and two processes
def test_trajectories_stage_on_two_processes_writes_the_same_bytes(tmp_path: Path) -> None:
    one = trajectories_workspace(tmp_path / "one")
    two = run_on_one_and_two(one, "trajectories")

    table = pl.read_parquet(one / "data/trajectories/train.parquet")
    # 12 rows in batches of 3 (each process decodes two, interleaved by prompt length) with
    # varied responses: equal files mean every row came back to its place.
    assert table.height == 12 and table["response"].n_unique() > 1
    assert (one / "data/trajectories/train.parquet").read_bytes() == (two / "data/trajectories/train.parquet").read_bytes()
    assert results(one / "metrics/trajectories.json") == results(two / "metrics/trajectories.json")
    no_leftovers(two)


def test_launch_argv_runs_accelerate_and_torchrun_from_this_interpreter() -> None:
    assert launch_argv("sft", "accelerate launch --multi_gpu --num_processes 8") == [
        sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes", "8", "-m", "tasks.sft",
    ]  # fmt: skip
    assert launch_argv("cft", "torchrun --nproc_per_node=4")[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert launch_argv("cft", "srun python")[-2:] == ["-m", "tasks.cft"]
    assert requested_processes("accelerate launch --multi_gpu --num_processes 2") == 2
    assert requested_processes("torchrun --nproc_per_node=4") == 4
    assert requested_processes("accelerate launch --num_processes=16 --num_machines 2") == 16
    assert requested_processes("accelerate launch --config_file configs/accelerate/1node-8gpu.yaml") is None


@pytest.mark.integration  # runs a stage process under a launcher
def test_a_single_process_stage_refuses_to_run_under_a_launcher(tmp_path: Path) -> None:
    """`prepare` writes its outputs from one process: under a launcher of 2 it stops with a clear error."""
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    env = {**os.environ, "WORLD_SIZE": "2", "GR2_TRACKING": "off", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tasks.prepare"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "stage prepare runs in one process" in proc.stderr


@pytest.mark.slow  # ~35 s: `accelerate launch` itself starts slowly
def test_accelerate_without_multi_gpu_is_an_error_not_one_silent_process(tmp_path: Path) -> None:
    """`accelerate launch --num_processes 2` alone starts one process (its simple launcher): the
    stage says so instead of running as if it had two."""
    ws = sft_workspace(tmp_path / "ws")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GR2_TRACKING": "off", "PYTHONPATH": str(ROOT)}
    env["GR2_LAUNCH"] = "accelerate launch --num_processes 2"
    proc = subprocess.run([sys.executable, "-m", "tasks.sft"], cwd=ws, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "asks for 2 processes but sft runs in one" in proc.stderr
    assert not (ws / "checkpoints/gr2-sft").exists()


def cft_workspace(path: Path) -> Path:
    """What `tasks.cft` reads: trajectories (the toy task's 24 prompt/response pairs) and a GR2 checkpoint."""
    write_toy_stage_inputs(path, "data/trajectories/train.parquet", "valid_permutation", "checkpoints/gr2", "ar_rl")
    params = {"seed": 0, "valid_fraction": 0.2, "train": {"epochs": 2, "batch_size": 6, "lr": 1e-3, "warmup_steps": 2, "block_size": 4}}
    (path / "params.yaml").write_text(yaml.safe_dump({"cft": params, "resume": {"every_steps": 0, "every_minutes": 0}}))
    return path


@pytest.mark.slow  # ~30 s; the library's two-process CFT test (tests/test_cft.py) runs by default
def test_cft_stage_on_two_processes_equals_one_process(tmp_path: Path) -> None:
    """20 training trajectories in global batches of 6 (6, 6, 6, 2): the partial batch is split 1 + 1."""
    one = cft_workspace(tmp_path / "one")
    two = run_on_one_and_two(one, "cft")
    ra, rb = same_weights_and_metrics(one, two, "checkpoints/dgr2-cft", "cft")
    assert ra["steps"] == rb["steps"] == 8
    no_leftovers(two)


def test_reproduce_reruns_with_the_recorded_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.reproduce import _rebuild_launch

    monkeypatch.delenv("GR2_LAUNCH", raising=False)
    launch = "accelerate launch --config_file configs/accelerate/1node-8gpu.yaml"
    env: dict[str, str] = {}
    notes: list[str] = []
    _rebuild_launch(env, {"runtime.launch": launch, "runtime.num_processes": "8"}, notes)
    assert env["GR2_LAUNCH"] == launch and "8 processes" in notes[0]
    env, notes = {"GR2_LAUNCH": launch}, []
    _rebuild_launch(env, {"runtime.launch": "python", "runtime.num_processes": "1"}, notes)
    assert "GR2_LAUNCH" not in env and notes  # built in one process: rebuilt in one
    env = {"GR2_LAUNCH": launch}
    _rebuild_launch(env, {}, [])  # registered before launchers were recorded
    assert "GR2_LAUNCH" not in env


@pytest.mark.slow  # ~40 s
def test_ar_rl_stage_on_two_processes_equals_one_process(tmp_path: Path) -> None:
    """DAPO under 2 processes: every rollout row samples from its own stream (seeded by
    step, round, prompt slot and group member) and the kept rollouts of both processes are
    shuffled into minibatches as one list, so the run equals one process: the same
    rollouts, rewards and steps, weights to float-sum order."""
    one = trajectories_workspace(tmp_path / "one")
    shutil.copytree(one / "checkpoints/gr2", one / "checkpoints/gr2-sft")
    shutil.rmtree(one / "checkpoints/gr2")
    train = {"steps": 3, "prompts_per_step": 4, "group_size": 4, "minibatch_size": 8, "max_new_tokens": 12, "lr": 1e-3}
    (one / "params.yaml").write_text(yaml.safe_dump({"ar_rl": {"max_prompts": 0, "train": train}, "resume": {"every_steps": 1, "every_minutes": 0}}))
    two = run_on_one_and_two(one, "ar_rl")
    ra, rb = same_weights_and_metrics(one, two, "checkpoints/gr2", "ar_rl", abs_tol=1e-7)
    assert ra["steps"] == rb["steps"] == 3 and rb["prompts_available"] == 12
    assert (two / "checkpoints/gr2/COMPLETE").exists()
    assert not (two / ".gr2/resume/ar_rl").exists()  # states saved every step, removed by the main process
    no_leftovers(two)


@pytest.mark.slow  # the smoke pipeline (shared fixture) plus ~45 s
@pytest.mark.integration  # reads the shared smoke run
def test_evaluate_accuracy_rows_on_two_processes_equal_one_process(smoke_run: dict, tmp_path: Path) -> None:
    """`evaluate` on the smoke pipeline's checkpoints, decoding in batches of 4 (3 per split, so
    the two processes share them): every non-timing number of metrics/evaluate.json is equal."""
    from flows.reproduce import is_timing, numeric_leaves

    copies = []
    for name in ("one", "two"):
        ws = tmp_path / name
        shutil.copytree(smoke_run["ws"], ws, ignore=shutil.ignore_patterns("mlruns", "mlflow.db", ".dvc", "dvc-remote", "logs"))
        params = yaml.safe_load((ws / "params.yaml").read_text())
        params["evaluate"]["batch_size"] = 4
        (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        (ws / "metrics/evaluate.json").unlink()
        copies.append(ws)
    run_stage(copies[0], "evaluate", 1)
    assert "evaluate on 2 processes (MULTI_CPU)" in run_stage(copies[1], "evaluate", 2).stderr
    a, b = (numeric_leaves(json.loads((ws / "metrics/evaluate.json").read_text())) for ws in copies)
    keys = [k for k in a.keys() | b.keys() if not is_timing(k)]
    assert len(keys) > 100 and any(k.startswith("dgr2") for k in keys)
    assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}


@pytest.mark.integration  # reads the shared smoke run's MLflow store
def test_stage_runs_and_registered_versions_record_the_launcher(smoke_run: dict) -> None:
    """The smoke pipeline ran every stage in one process: the distributed stages' runs say so
    (`runtime.launch` python, 1 process), the single-process ones carry no launcher, and the
    registered versions carry their stage run's launcher (what `gr2 reproduce` reuses)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{smoke_run['ws'] / 'mlflow.db'}")
    exp = client.get_experiment_by_name("diffusion-gr2")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("gr2.stage")}
    for stage in ("sft", "trajectories", "cft", "evaluate"):
        tags = runs[stage].data.tags
        assert (tags["runtime.launch"], tags["runtime.num_processes"], tags["runtime.distributed_type"]) == ("python", "1", "NO")
    assert "runtime.launch" not in runs["prepare"].data.tags
    version = client.get_model_version_by_alias("gr2", "challenger")
    assert version.tags["runtime.launch"] == "python" and version.tags["runtime.num_processes"] == "1"
