"""`gr2 serve`: MLflow's scoring server for a registered model, behind a cap on the request body.

`mlflow models serve` reads and parses a request body whole, whatever its size,
before the model sees a row, so the model's own caps (rows, history length,
max_new_tokens: `ServeLimits` in flows/registry.py, answered 400) come too late
for a body of gigabytes. `gr2 serve` runs the same scoring app (MLflow's
`scoring_server.init`, what `mlflow models serve --env-manager local` runs) in
uvicorn, wrapped in `BodySizeLimit`, which answers 413 as soon as a body passes
the version's `max_body_bytes`: at once from Content-Length, or while reading a
chunked body, before the scoring app is called.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MODEL_PATH_ENV = "GR2_SERVE_MODEL_PATH"
DRAIN_LIMIT = 64 * 2**20


async def _answer(send: Send, status: int, message: str) -> None:
    # The same JSON shape as MLflow's own error answers.
    code = {413: "REQUEST_LIMIT_EXCEEDED", 400: "BAD_REQUEST"}[status]
    body = json.dumps({"error_code": code, "message": message}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """ASGI middleware: refuse (413) any HTTP request whose body is over `max_bytes`, before `app` runs.

    The body is read here (the scoring app reads it whole anyway) and handed on
    in one piece, so a body over the cap is never buffered beyond the cap plus
    one chunk, and the inner app never sees it.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _drain(self, receive: Receive, size: int) -> None:
        """Read and drop the rest of a refused body, up to DRAIN_LIMIT bytes in all.

        A client such as urllib or requests sends the whole body before it reads
        the answer; closing the connection under it would turn the 413 into a
        connection reset. Nothing is kept, so draining costs no memory; past the
        limit the connection is dropped instead.
        """
        while size <= DRAIN_LIMIT:
            message = await receive()
            size += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    def _too_large(self, size: str) -> str:
        return f"request body of {size} bytes; at most {self.max_bytes} (serve.max_body_bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _answer(send, 400, f"Content-Length {declared[:40].decode(errors='replace')!r} is not a byte count")
                return
            if int(declared) > self.max_bytes:
                await self._drain(receive, 0)
                await _answer(send, 413, self._too_large(str(int(declared))))
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left; nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                if message.get("more_body", False):
                    await self._drain(receive, size)
                await _answer(send, 413, self._too_large(f"more than {self.max_bytes}"))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, as the app expects

        await self.app(scope, replay, send)


def build_app(model: Any) -> ASGIApp:
    """MLflow's scoring app for a loaded pyfunc model, capped at the version's `max_body_bytes`."""
    from mlflow.pyfunc import scoring_server

    from flows.registry import ServeLimits

    limits = ServeLimits.from_model_config(getattr(model, "model_config", None))
    return BodySizeLimit(scoring_server.init(model), limits.max_body_bytes)


def create_app() -> ASGIApp:
    """uvicorn's factory (`uvicorn --factory flows.serving_app:create_app`): the model in GR2_SERVE_MODEL_PATH."""
    from mlflow.pyfunc import scoring_server

    return build_app(scoring_server.load_model_with_mlflow_config(os.environ[MODEL_PATH_ENV]))
