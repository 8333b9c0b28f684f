"""Shared fixtures: the shared data set, quiet tool settings, no MLflow unless a test asks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "Beauty.txt").exists():
        pytest.skip(f"shared data set not found at {SHARED_DATA}")
    return SHARED_DATA
