"""The champion re-ranker served over real HTTP by `mlflow models serve --env-manager local`.

The model is the one the smoke pipeline registered (session fixture `smoke_run`):
`diffusion-gr2` when the pipeline registers one, else `gr2`. It becomes
`champion` through the real promotion path (gates relaxed: a smoke model is
trained for seconds and mostly answers invalidly, which the output reports).
One server for the module on a free loopback port, stopped by its process id.
The request check itself (`validate_rerank_input`) is also tested directly, fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from flows.bench_serve import stop
from flows.schedule import free_port

STARTUP_TIMEOUT_S = 120  # measured ~15 s on a loaded 2-core machine


def _post(url: str, body: bytes | str | dict[str, Any], content_type: str = "application/json") -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


@pytest.fixture(scope="module")
def served(smoke_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import polars as pl
    from mlflow import MlflowClient

    from flows.promote import ModelGates, PromoteConfig, promote

    ws: Path = smoke_run["ws"]
    store = f"sqlite:///{ws / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    names = {m.name for m in client.search_registered_models()}
    name = "diffusion-gr2" if "diffusion-gr2" in names else "gr2"
    relaxed = ModelGates(tolerance=1.0, min_valid_permutation=0.0)
    decision = promote(name, None, ws, PromoteConfig(models={name: relaxed}), client=client)
    assert decision.status in ("promoted", "already-champion"), decision.summary()

    port = free_port()
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": store,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",  # --env-manager local runs the venv's uvicorn
        "OMP_NUM_THREADS": "1",
    }
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [str(bin_dir / "mlflow"), "models", "serve", "-m", f"models:/{name}@champion", "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow models serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        from tasks.traces import load_lists

        lists = load_lists(ws, "test").head(2)
        # The lists' evidence levels go with the request when the model's prompts carry them.
        keys = ["history", "candidates"] + (["evidence"] if "evidence" in lists.columns else [])
        yield {
            "url": url,
            "name": name,
            "version": decision.version,
            "rows": lists.select(keys).to_dicts(),
            "max_item": int(pl.read_parquet(ws / "data/prepared/items.parquet")["item_id"].max()),
            "proc": proc,
        }
    finally:
        stop(proc)  # the server and its uvicorn worker share the process group it was started in
    assert proc.poll() is not None


@pytest.mark.integration
def test_served_champion_ranks_real_requests(served: dict[str, Any]) -> None:
    rows = served["rows"]
    status, body = _post(f"{served['url']}/invocations", {"dataframe_records": rows, "params": {"max_new_tokens": 24}})
    assert status == 200, body
    preds = body["predictions"]
    assert len(preds) == len(rows)
    for pred, row in zip(preds, rows, strict=True):
        assert sorted(pred["ranking"]) == sorted(row["candidates"])  # a permutation, even when the answer was invalid
        assert isinstance(pred["valid"], bool) and isinstance(pred["explanation"], str)
    # the other JSON layout (columns) gives the same kind of answer
    cols = {k: [v] for k, v in rows[0].items()}
    status, body = _post(f"{served['url']}/invocations", {"inputs": cols, "params": {"max_new_tokens": 8, "tau": 0.9}})
    assert status == 200, body
    assert sorted(body["predictions"][0]["ranking"]) == sorted(rows[0]["candidates"])
    if served["name"] == "diffusion-gr2":  # it decodes at its registered setting (evaluate's tau 0.9), no other
        status, body = _post(f"{served['url']}/invocations", {"inputs": cols, "params": {"max_new_tokens": 8, "tau": 0.5}})
        assert status == 400 and "this version serves tau 0.9" in body["message"], body


def _bad_requests(served: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """name -> (request body, what the 4xx answer must say)."""
    row = served["rows"][0]
    h, c = row["history"], row["candidates"]
    unknown = served["max_item"] + 1000
    rec = lambda **kw: {"dataframe_records": [{**row, **kw}]}  # noqa: E731
    if "evidence" in row:
        ev = row["evidence"]
        extra = {
            "evidence missing": ({"dataframe_records": [{"history": h, "candidates": c}]}, "row 0: evidence: missing"),
            "evidence for too few candidates": (rec(evidence=ev[:-1]), "row 0: evidence: malformed"),
        }
    else:
        extra = {"evidence to a model without": (rec(evidence=[[0]] * len(c)), "carry no evidence")}
    return {
        **extra,
        "unknown candidate": (rec(candidates=[*c[:-1], unknown]), f"row 0: candidates: unknown item ids [{unknown}]"),
        "unknown history item": (rec(history=[*h, unknown]), f"row 0: history: unknown item ids [{unknown}]"),
        "too few candidates": (rec(candidates=c[:-1]), f"row 0: candidates: {len(c) - 1} items; the model ranks exactly {len(c)}"),
        "too many candidates": (rec(candidates=[*c, h[0]]), f"items; the model ranks exactly {len(c)}"),
        "duplicated candidates": (rec(candidates=[*c[:-1], c[0]]), f"row 0: candidates: duplicated item ids [{c[0]}]"),
        "empty history": (rec(history=[]), "row 0: history: empty"),
        "history as a string": (rec(history="1 2 3"), "row 0: history: must be a list of integer item ids, got str"),
        "candidates as floats": (rec(candidates=[x + 0.5 for x in c]), "row 0: candidates: must be a list of integer item ids, got float"),
        "history missing": (rec(history=None), "row 0: history: missing"),
        "second row bad": ({"dataframe_records": [{"history": h, "candidates": c}, {"history": h, "candidates": [True] * len(c)}]}, "row 1: candidates: must be a list of integer item ids, got bool"),
        "missing column": ({"dataframe_records": [{"history": h}]}, "missing column 'candidates'"),
        "misspelt column": ({"dataframe_records": [{"history": h, "candidates": c, "candidate": c}]}, "unknown column 'candidate'"),
        "no rows": ({"dataframe_records": []}, "no rows"),
        "bad tau": ({**rec(), "params": {"tau": 1.5}}, "params: tau must be a number in (0, 1]"),
        "bad max_new_tokens": ({**rec(), "params": {"max_new_tokens": "many"}}, "max_new_tokens"),
        "not JSON": ("{history: [1, 2", "Invalid input"),
        "no data key": ({"rows": [row]}, "dataframe_records"),
    }


@pytest.mark.integration
def test_bad_requests_get_a_4xx_that_says_what_is_wrong(served: dict[str, Any]) -> None:
    failures = []
    for name, (body, expected) in _bad_requests(served).items():
        status, answer = _post(f"{served['url']}/invocations", body)
        message = answer.get("message", "") if isinstance(answer, dict) else str(answer)
        if not (400 <= status < 500 and expected in message):
            failures.append(f"{name}: HTTP {status}, {message[:300]!r} (expected 4xx saying {expected!r})")
    status, answer = _post(f"{served['url']}/invocations", "history,candidates\n1,2\n", content_type="text/plain")
    if status != 415:
        failures.append(f"wrong content type: HTTP {status}")
    assert not failures, "\n".join(failures)
    # none of them took the server down
    assert served["proc"].poll() is None
    status, body = _post(f"{served['url']}/invocations", {"dataframe_records": served["rows"][:1], "params": {"max_new_tokens": 8}})
    assert status == 200, body


# --- the request check without a server (fast) ----------------------------------------------

KNOWN = set(range(1, 101))
CANDS = list(range(10, 20))


def _problems(model_input: Any, num_candidates: int | None = 10) -> str:
    from mlflow.exceptions import MlflowException

    from flows.registry import validate_rerank_input

    with pytest.raises(MlflowException) as err:
        validate_rerank_input(model_input, KNOWN, num_candidates)
    assert err.value.get_http_status_code() == 400
    return err.value.message


def test_valid_input_in_every_layout() -> None:
    import numpy as np
    import pandas as pd

    from flows.registry import validate_rerank_input

    want = ([[1, 2]], [CANDS])
    assert validate_rerank_input(pd.DataFrame({"history": [[1, 2]], "candidates": [CANDS]}), KNOWN, 10) == want
    assert validate_rerank_input({"history": np.array([[1, 2]]), "candidates": np.array([CANDS])}, KNOWN, 10) == want
    assert validate_rerank_input([{"history": (1, 2), "candidates": CANDS}], KNOWN, 10) == want
    assert validate_rerank_input([{"history": [1], "candidates": [10, 11, 12]}], KNOWN, None) == ([[1]], [[10, 11, 12]])


def test_every_problem_is_named_with_its_row_and_field() -> None:
    import pandas as pd

    msg = _problems(pd.DataFrame({"history": [[1], [], "1 2", [1, 500]], "candidates": [CANDS, CANDS[:9], [*CANDS[:9], 10], [*CANDS[:9], 1.5]]}))
    assert "row 0" not in msg
    assert "row 1: history: empty" in msg and "row 1: candidates: 9 items; the model ranks exactly 10" in msg
    assert "row 2: history: must be a list of integer item ids, got str '1 2'" in msg and "row 2: candidates: duplicated item ids [10]" in msg
    assert "row 3: history: unknown item ids [500]" in msg and "row 3: candidates: must be a list of integer item ids, got float" in msg
    assert "missing column 'candidates'" in _problems([{"history": [1]}])
    assert "unknown column 'k'" in _problems([{"history": [1], "candidates": CANDS, "k": 3}])
    assert "no rows" in _problems({}) and "no rows" in _problems(pd.DataFrame({"history": [], "candidates": []}))
    assert "at least 2 are needed" in _problems([{"history": [1], "candidates": [10]}], num_candidates=None)
    assert "got str" in _problems("history=1")


def test_request_params_are_checked() -> None:
    from mlflow.exceptions import MlflowException

    from flows.registry import rerank_params

    assert rerank_params(None) == {"max_new_tokens": 320, "tau": 0.9}
    assert rerank_params({"max_new_tokens": 16, "tau": 1}) == {"max_new_tokens": 16, "tau": 1.0}
    for bad, says in [({"tau": 0}, "tau must be"), ({"max_new_tokens": 0}, "max_new_tokens must be"), ({"max_new_tokens": True}, "max_new_tokens"), ({"beam": 4}, "unknown key 'beam'")]:
        with pytest.raises(MlflowException, match=says):
            rerank_params(bad)


def test_evidence_is_checked_against_the_models_format() -> None:
    import pandas as pd
    from mlflow.exceptions import MlflowException

    from flows.registry import validate_rerank_evidence

    cands = [CANDS[:3]]
    good = [[0, 7], [1, 2], [3, 3]]
    assert validate_rerank_evidence(pd.DataFrame({"history": [[1]], "candidates": cands, "evidence": [good]}), cands, 2) == [good]
    # A model without evidence needs none and refuses it; one with evidence needs it for every row.
    assert validate_rerank_evidence([{"history": [1], "candidates": cands[0]}], cands, 0) is None
    cases = {
        "refused": ([{"history": [1], "candidates": cands[0], "evidence": good}], 0, "carry no evidence"),
        "missing": ([{"history": [1], "candidates": cands[0]}], 2, "row 0: evidence: missing"),
        "too few candidates": ([{"history": [1], "candidates": cands[0], "evidence": good[:2]}], 2, "row 0: evidence: malformed"),
        "level too high": ([{"history": [1], "candidates": cands[0], "evidence": [[0, 8], [1, 2], [3, 3]]}], 2, "in 0..7"),
        "not integers": ([{"history": [1], "candidates": cands[0], "evidence": [[0.5, 1], [1, 2], [3, 3]]}], 2, "malformed"),
        "a string": ([{"history": [1], "candidates": cands[0], "evidence": "0 1"}], 2, "malformed"),
    }
    for name, (rows, n_features, expected) in cases.items():
        with pytest.raises(MlflowException) as err:
            validate_rerank_evidence(rows, cands, n_features)
        assert err.value.get_http_status_code() == 400 and expected in err.value.message, name


@pytest.mark.integration
@pytest.mark.slow  # a second server and the decode of 8 lists (~1 min)
def test_served_champion_answers_what_its_evaluate_row_ranked(served: dict[str, Any], smoke_run: dict[str, Any]) -> None:
    """`gr2 serve-check`: the promoted version served by `gr2 serve` ranks the first test lists exactly as
    the evaluate row its eval tags came from (reports/rankings.parquet), list for list."""
    ws: Path = smoke_run["ws"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{ws / 'mlflow.db'}", "OMP_NUM_THREADS": "1"}
    gr2 = Path(sys.executable).parent / "gr2"
    proc = subprocess.run(
        # 8: the smoke profile evaluates the first 12 lists of each split (evaluate.max_examples)
        [str(gr2), "serve-check", f"{served['name']}@champion", "--examples", "8", "--batch", "4", "--root", str(ws)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "8 of 8 rankings equal - PASSED" in proc.stdout
