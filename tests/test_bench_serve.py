"""`gr2 bench serve`: a bounded load test of a served re-ranker on loopback (it must answer every
request, good or bad, correctly and within its limits under concurrent load).

The checker runs against a stand-in re-ranker (a pyfunc that validates requests
with the real `validate_rerank_input` and caps, and ranks without a language
model) served by the real `gr2 serve`: fast enough for the default suite. A
second stand-in that answers wrong rankings shows the checker fails when it
should. The `slow` test runs the command on the smoke pipeline's champion.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flows.bench_serve import _percentile, request_mix
from flows.registry import ServeLimits

ROWS = [{"history": [1 + i, 2 + i, 3 + i], "candidates": list(range(10 + i, 20 + i))} for i in range(5)]


def test_request_mix_is_bounded_and_deterministic() -> None:
    limits = ServeLimits(max_rows=4, max_history=20, max_new_tokens=32, max_body_bytes=5000)
    mix = request_mix(ROWS, limits, n=50, bad_share=0.2, max_new_tokens=8, seed=1)
    assert len(mix) == 50 and sum(r.kind != "good" for r in mix) == 10
    assert len({r.kind for r in mix}) == 9  # good + the 8 kinds of fault, each at least once
    assert [r.body for r in mix] == [r.body for r in request_mix(ROWS, limits, n=50, bad_share=0.2, max_new_tokens=8, seed=1)]
    body = {r.kind: r for r in mix}
    assert len(body["body over the cap"].body) > limits.max_body_bytes and body["body over the cap"].expect == (413,)
    assert len(json.loads(body["history over the cap"].body)["dataframe_records"][0]["history"]) == limits.max_history + 1
    assert len(json.loads(body["rows over the cap"].body)["dataframe_records"]) == limits.max_rows + 1
    assert _percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and _percentile([1.0] * 99 + [9.0], 99) == 1.0 and _percentile([], 99) == 0.0


def _save_stand_in(path: Path, wrong: bool, model_config: dict[str, Any]) -> None:
    import mlflow.pyfunc

    # Defined here so cloudpickle stores the class by value: the server process cannot import tests/.
    class StandIn(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):  # noqa: ANN001, ANN201 - no hints: MLflow would infer a signature
            import pandas as pd

            from flows.registry import ServeLimits, rerank_params, validate_rerank_input

            limits = ServeLimits.from_model_config(context.model_config)
            _, cands = validate_rerank_input(model_input, set(range(1, 100)), 10, limits)
            rerank_params(params, limits)
            return pd.DataFrame({"ranking": [c[:-1] + c[:1] if wrong else c[::-1] for c in cands]})

    from mlflow.models import ModelSignature
    from mlflow.types import ParamSchema, ParamSpec

    sig = ModelSignature(inputs=None, outputs=None, params=ParamSchema([ParamSpec("max_new_tokens", "long", 16), ParamSpec("tau", "double", 0.9)]))
    mlflow.pyfunc.save_model(path, python_model=StandIn(), pip_requirements=[], model_config=model_config, signature=sig)


@pytest.mark.integration
def test_load_test_passes_on_a_sound_server_and_fails_on_wrong_rankings(tmp_path: Path) -> None:
    from flows.bench_serve import bench_serve

    config = {"max_rows": 8, "max_history": 50, "max_new_tokens": 64, "max_body_bytes": 20_000}
    _save_stand_in(tmp_path / "sound", wrong=False, model_config=config)
    report = bench_serve(tmp_path / "sound", ROWS, requests=80, concurrency=8, bad_share=0.25, max_new_tokens=8, log_path=tmp_path / "sound.log")
    assert report.passed, report.text()
    assert report.status_counts.get("200") == 60 and report.alive_after
    assert 0 < report.latency_good["p50"] <= report.latency_good["p95"] <= report.latency_good["p99"] and report.throughput > 0
    assert {"400", "413"} <= set(report.status_counts) and not any(s.startswith("5") or s == "0" for s in report.status_counts)

    _save_stand_in(tmp_path / "wrong", wrong=True, model_config=config)
    report = bench_serve(tmp_path / "wrong", ROWS, requests=20, concurrency=4, bad_share=0.0, max_new_tokens=8)
    assert not report.passed and len(report.failures) == 20 and "not a permutation" in report.failures[0]


@pytest.mark.slow
@pytest.mark.integration
def test_bench_serve_on_the_smoke_champion(smoke_run: dict[str, Any], tmp_path: Path) -> None:
    """The documented load test (docs/operations.md): 400 requests, 8 at a time, 20% malformed or oversized, against the smoke champion."""
    from mlflow import MlflowClient

    from flows.promote import ModelGates, PromoteConfig, promote

    ws: Path = smoke_run["ws"]
    store = f"sqlite:///{ws / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    name = "diffusion-gr2" if "diffusion-gr2" in {m.name for m in client.search_registered_models()} else "gr2"
    relaxed = ModelGates(tolerance=1.0, min_valid_permutation=0.0)  # a smoke model trained for seconds: gates relaxed
    assert promote(name, None, ws, PromoteConfig(models={name: relaxed}), client=client).status in ("promoted", "already-champion")
    out = tmp_path / "bench.json"
    gr2 = Path(sys.executable).parent / "gr2"
    env = {"MLFLOW_TRACKING_URI": store, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(gr2), "--root", str(ws), "bench", "serve", "--out", str(out)], capture_output=True, text=True, timeout=1800, env={**__import__("os").environ, **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["requests"] == 400 and report["concurrency"] == 8
    print(proc.stdout)
