"""Shared fixtures: the shared data set, quiet tool settings, no MLflow unless a test asks."""

from __future__ import annotations

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


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny test models are dominated by per-op overhead: one thread is faster and
    does not oversubscribe a 2-core CI machine (measured: 2 threads ran the AR
    decode tests 8-10x slower under load). Restored after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "Beauty.txt").exists():
        pytest.skip(f"shared data set not found at {SHARED_DATA}")
    return SHARED_DATA
