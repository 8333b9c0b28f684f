"""Shared fixtures: the shared data set, quiet tool settings, no MLflow unless a test asks, and the
raw-id model and prompts of the decoders' tests (`model`, `prompts`)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "datasets" / "amazon-beauty"

for key, value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
    "GR2_TRACKING": "off",
}.items():
    os.environ.setdefault(key, value)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `-n 2` (the README's test command) every module that reads the smoke run (`smoke_run`, a
    few minutes to build) goes to one worker, so the smoke run is built once per run, not once per
    worker; the other modules go whole to whichever worker is free, so a module's own fixtures are
    built once too. (`--dist loadgroup` would do it by mark, but xdist 3.8 names the groups through
    a node attribute pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SmokeRunScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "smoke_run" if _reads_smoke_run(module) else module

    return SmokeRunScheduling(config, log)


@functools.cache
def _reads_smoke_run(module: str) -> bool:
    path = ROOT / module
    return path.suffix == ".py" and path.exists() and "smoke_run" in path.read_text()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny test models are dominated by per-op overhead: one thread is faster and
    does not oversubscribe a 2-core CI machine (measured: 2 threads ran the AR
    decode tests 8-10x slower under load). Restored after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The raw-id decoder model of the decoders' tests (`tiny.random_model`: DECODER over VOCAB ids,
    seed 0, scale 0.3), one per module. It is also the block-diffusion model of the diffusion
    tests: conversion is a weight copy (tests/test_block_diffusion.py), and the decoders pass
    their own masks. A module that needs another model defines its own `model`."""
    from tiny import random_model

    return random_model()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """The raw-id prompts of the decoders' tests (`tiny.random_ids`: lengths 3, 11, 1, 7, 16, so
    batches are left-padded and ragged), one list per module."""
    from tiny import random_ids

    return random_ids()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "Beauty.txt").exists():
        pytest.skip(f"shared data set not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory):
    """One Prefect test API for the session (about 10 s to start), isolated from the
    user's Prefect home and result storage, with no end-of-flow heartbeat wait
    (shared/notes/STACK.md)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, PREFECT_HOME, PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    from flows.prefect_api import STARTUP_TIMEOUT_S

    base = tmp_path_factory.mktemp("prefect")
    with temporary_settings(
        updates={
            PREFECT_HOME: str(base / "home"),
            PREFECT_RESULTS_LOCAL_STORAGE_PATH: str(base / "results"),
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
        }
    ):
        with prefect_test_harness(server_startup_timeout=STARTUP_TIMEOUT_S):  # 30 s by default: short under load
            yield


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory: pytest.TempPathFactory, shared_data: Path, prefect_harness) -> dict:
    """The whole pipeline on a smoke workspace, run twice (about 2 minutes), once per test session.

    Returns {"ws": the workspace folder (its own git, DVC cache and MLflow store
    in ws/mlflow.db), "first": the first run's stage summaries, "second": the
    second's (everything up to date)}. Tests that change the workspace's registry
    (promotion, serving) only add aliases and tags. The data is a DVC-versioned
    snapshot in ws/raw (pushed to the workspace's default remote, ws/dvc-remote),
    so every registered version can be rebuilt by hash (`gr2 reproduce`).
    """
    from flows.pipeline import pipeline
    from flows.workspace import make_workspace

    base = tmp_path_factory.mktemp("smoke")
    ws = make_workspace(ROOT, base / "ws", profile="smoke", snapshot=True)
    saved = {k: os.environ.get(k) for k in ("GR2_TRACKING", "MLFLOW_TRACKING_URI", "GR2_ROOT", "OMP_NUM_THREADS")}
    os.environ["GR2_TRACKING"] = "on"
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{ws / 'mlflow.db'}"
    # One intra-op thread in the stage processes: bit-for-bit reproduction holds at a
    # fixed thread count, and with 2 threads the retrieve stage's outputs differed
    # between two runs (measured); the versions record it and `gr2 reproduce` reuses it.
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        first = pipeline(root=str(ws))
        second = pipeline(root=str(ws))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"ws": ws, "first": first, "second": second}
