"""Request caps of the served re-rankers: beyond a cap the answer is 400 (413 for the body), before any decoding.

The caps (`ServeLimits`: rows, history length, max_new_tokens, body bytes) come
from params.yaml `serve:` into each version's model_config. The row, history
and max_new_tokens caps are checked by the model (`validate_rerank_input`,
`rerank_params`); the body cap by the ASGI front of `gr2 serve`
(`BodySizeLimit`), tested here on a toy app and on MLflow's real scoring app.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.registry import ServeLimits, load_serve_limits, rerank_params, validate_rerank_input
from tasks.common import ParamsError

KNOWN = set(range(1, 2001))
CANDS = list(range(10, 20))


def _refused(fn: Any, *args: Any) -> str:
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException) as err:
        fn(*args)
    assert err.value.get_http_status_code() == 400
    return err.value.message


def test_history_cap() -> None:
    limits = ServeLimits(max_history=50)
    assert validate_rerank_input([{"history": list(range(1, 51)), "candidates": CANDS}], KNOWN, 10, limits)[0] == [list(range(1, 51))]
    msg = _refused(validate_rerank_input, [{"history": [1], "candidates": CANDS}, {"history": list(range(1, 52)), "candidates": CANDS}], KNOWN, 10, limits)
    assert "row 1: history: 51 items; at most 50" in msg and "row 0" not in msg
    # The default cap refuses a history 2,000 times too long (default history_len 10).
    msg = _refused(validate_rerank_input, [{"history": [1] * 20_000, "candidates": CANDS}], KNOWN, 10)
    assert "row 0: history: 20000 items; at most 1000" in msg


def test_rows_cap() -> None:
    row = {"history": [1, 2], "candidates": CANDS}
    assert len(validate_rerank_input([row] * 3, KNOWN, 10, ServeLimits(max_rows=3))[0]) == 3
    assert "4 rows; at most 3 per request" in _refused(validate_rerank_input, [row] * 4, KNOWN, 10, ServeLimits(max_rows=3))
    assert "257 rows; at most 256 per request" in _refused(validate_rerank_input, [row] * 257, KNOWN, 10)


def test_max_new_tokens_cap() -> None:
    limits = ServeLimits(max_new_tokens=64)
    assert rerank_params({"max_new_tokens": 64}, limits)["max_new_tokens"] == 64
    assert "max_new_tokens must be an integer in 1..64, got 65" in _refused(rerank_params, {"max_new_tokens": 65}, limits)
    assert "in 1..1024, got 100000" in _refused(rerank_params, {"max_new_tokens": 100_000})
    # With a cap under the usual default, the default follows the cap rather than failing every request.
    assert rerank_params(None, ServeLimits(max_new_tokens=100))["max_new_tokens"] == 100
    assert rerank_params(None)["max_new_tokens"] == 320


def test_limits_from_params_and_model_config(tmp_path: Path) -> None:
    # Versions registered before limits existed serve with the defaults; unrelated keys are ignored.
    assert ServeLimits.from_model_config(None) == ServeLimits()
    assert ServeLimits.from_model_config({"num_candidates": 10, "max_rows": 8}) == ServeLimits(max_rows=8)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"sft": {}}))
    assert load_serve_limits(tmp_path) == ServeLimits()
    path.write_text(yaml.safe_dump({"serve": {"max_history": 20}}))
    assert load_serve_limits(tmp_path) == ServeLimits(max_history=20)
    for bad, field in [({"max_rows": 0}, "serve.max_rows"), ({"max_body_bytes": "big"}, "serve.max_body_bytes"), ({"max_rowz": 3}, "serve.max_rowz")]:
        path.write_text(yaml.safe_dump({"serve": bad}))
        with pytest.raises(ParamsError, match=rf"params.yaml: {field}"):
            load_serve_limits(tmp_path)
    # The project's own params validate and keep the documented defaults' order of magnitude.
    root = load_serve_limits(Path(__file__).resolve().parents[1])
    assert root.max_rows >= 1 and root.max_body_bytes >= 2**20


# --- the body cap ---------------------------------------------------------------------------


def _call(app: Any, chunks: list[bytes], content_length: int | str | None) -> tuple[int, bytes]:
    """Send one POST through an ASGI app; returns (status, response body)."""
    headers = [(b"content-type", b"application/json")] + ([(b"content-length", str(content_length).encode())] if content_length is not None else [])
    scope = {"type": "http", "method": "POST", "path": "/invocations", "headers": headers}
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


seen: list[bytes] = []  # the bodies `_echo` received


async def _echo(scope: Any, receive: Any, send: Any) -> None:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    seen.append(body)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_body_cap_answers_413_before_the_app_runs() -> None:
    from flows.serving_app import BodySizeLimit

    app = BodySizeLimit(_echo, max_bytes=100)
    seen.clear()
    assert _call(app, [b"x" * 100], 100)[0] == 200
    assert _call(app, [b"x" * 40, b"y" * 60], None)[0] == 200  # chunked, at the cap
    assert seen == [b"x" * 100, b"x" * 40 + b"y" * 60]  # the app gets the whole body, in one piece
    seen.clear()
    status, body = _call(app, [b"x" * 101], 101)
    assert status == 413 and "request body of 101 bytes; at most 100 (serve.max_body_bytes)" in json.loads(body)["message"]
    status, body = _call(app, [b"x" * 60, b"y" * 60, b"z" * 10**6], None)  # chunked: refused once past the cap
    assert status == 413 and "more than 100" in json.loads(body)["message"]
    assert _call(app, [b"x"], "ten")[0] == 400  # a Content-Length that is no number
    assert seen == []  # none of the refused bodies reached the app


def test_body_cap_in_front_of_mlflows_scoring_app(tmp_path: Path) -> None:
    """The real scoring app behind the cap: small requests are served, a big one is 413, bad JSON still 400."""
    import mlflow.pyfunc
    from starlette.testclient import TestClient

    from flows.serving_app import build_app

    class Echo(mlflow.pyfunc.PythonModel):
        # Unannotated on purpose: MLflow would try to derive a signature from type hints.
        def predict(self, context, model_input, params=None):  # noqa: ANN001, ANN201
            return model_input

    path = tmp_path / "model"
    mlflow.pyfunc.save_model(path, python_model=Echo(), pip_requirements=[], model_config={"max_body_bytes": 2000})
    client = TestClient(build_app(mlflow.pyfunc.load_model(str(path))))
    ok = client.post("/invocations", json={"dataframe_records": [{"history": [1, 2, 3]}]})
    assert ok.status_code == 200, ok.text
    big = client.post("/invocations", json={"dataframe_records": [{"history": list(range(1000))}]})
    assert big.status_code == 413 and "at most 2000" in big.json()["message"]
    assert client.post("/invocations", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    assert client.get("/ping").status_code == 200


@pytest.mark.integration
def test_gr2_serve_caps_the_body_over_http(tmp_path: Path) -> None:
    """`gr2 serve` on a model folder, over real HTTP on a free loopback port; stopped by its pid (the server's)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    import mlflow.pyfunc

    class Echo(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):  # noqa: ANN001, ANN201
            return model_input

    path = tmp_path / "model"
    mlflow.pyfunc.save_model(path, python_model=Echo(), pip_requirements=[], model_config={"max_body_bytes": 5000})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gr2 = Path(sys.executable).parent / "gr2"
    log = tmp_path / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([str(gr2), "serve", str(path), "--port", str(port)], stdout=fh, stderr=subprocess.STDOUT, cwd=tmp_path)

    def post(body: bytes) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status
        except urllib.error.HTTPError as err:
            return err.code

    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.3)
        assert post(json.dumps({"dataframe_records": [{"history": [1, 2]}]}).encode()) == 200
        assert post(json.dumps({"dataframe_records": [{"history": list(range(2000))}]}).encode()) == 413
        # Far over the cap: the client (sending all before reading) still gets its 413, not a reset.
        assert post(b"[" * 6_000_000) == 413
        assert proc.poll() is None
    finally:
        os.kill(proc.pid, signal.SIGTERM)  # `gr2 serve` execs uvicorn: its pid is the server's
        proc.wait(timeout=30)
