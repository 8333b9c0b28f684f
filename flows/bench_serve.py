"""`gr2 bench serve`: a bounded load test of a served re-ranker on loopback.

Starts `gr2 serve` (MLflow's scoring app behind the body cap, flows/serving_app.py)
for one model on a free loopback port, sends a fixed number of requests with a
fixed concurrency, a share of them malformed or over a cap, then checks:
- no answer is a 5xx (nor a dropped connection);
- every good request got 200 and, per row, a ranking that is a permutation of its candidates;
- every bad request got the 4xx its kind calls for (400, or 413 for the body);
- the server still answers afterwards.
It reports latency percentiles (good requests, and all) and throughput, and
stops the server by its process id (`gr2 serve` execs uvicorn, so that pid is
the server's).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flows.registry import ServeLimits
from flows.schedule import free_port

STARTUP_TIMEOUT_S = 180  # a smoke model loads in ~15 s on a loaded 2-core machine


@dataclass(frozen=True)
class Request:
    """One request of the mix: its kind ("good" or the fault), body, and the statuses that count as right."""

    kind: str
    body: bytes
    expect: tuple[int, ...]
    candidates: list[list[int]] = field(default_factory=list)  # per row, for checking good answers


def _bad_requests(row: dict[str, Any], limits: ServeLimits, max_new_tokens: int) -> list[Callable[[], Request]]:
    """Makers of the malformed and oversized requests, each from one good row."""

    def req(kind: str, payload: Any, expect: tuple[int, ...] = (400,)) -> Request:
        return Request(kind, payload if isinstance(payload, bytes) else json.dumps(payload).encode(), expect)

    h, c = row["history"], row["candidates"]
    params = {"max_new_tokens": max_new_tokens}
    long_history = (h * (limits.max_history // max(len(h), 1) + 2))[: limits.max_history + 1]
    return [
        lambda: req("duplicate candidates", {"dataframe_records": [{**row, "candidates": [*c[:-1], c[0]]}], "params": params}),
        lambda: req("unknown item", {"dataframe_records": [{**row, "history": [*h, 10**9]}], "params": params}),
        lambda: req("history as text", {"dataframe_records": [{**row, "history": " ".join(map(str, h))}], "params": params}),
        lambda: req("not JSON", b'{"dataframe_records": [{"history": [1, 2'),
        # These two may also pass the body cap (a small max_body_bytes): 413 is as right as 400 then.
        lambda: req("history over the cap", {"dataframe_records": [{**row, "history": long_history}], "params": params}, (400, 413)),
        lambda: req("max_new_tokens over the cap", {"dataframe_records": [row], "params": {"max_new_tokens": limits.max_new_tokens + 1}}),
        lambda: req("rows over the cap", {"dataframe_records": [row] * (limits.max_rows + 1), "params": params}, (400, 413)),
        lambda: req("body over the cap", b'{"dataframe_records": [' + b" " * limits.max_body_bytes + b"]}", (413,)),
    ]


def request_mix(rows: list[dict[str, Any]], limits: ServeLimits, n: int, bad_share: float, max_new_tokens: int, seed: int) -> list[Request]:
    """`n` requests: good ones of one row each (rows in turn), and round(n * bad_share) faults, shuffled."""
    rng = random.Random(seed)
    n_bad = round(n * bad_share)
    out = []
    for i in range(n - n_bad):
        row = rows[i % len(rows)]
        body = {"dataframe_records": [row], "params": {"max_new_tokens": max_new_tokens}}
        out.append(Request("good", json.dumps(body).encode(), (200,), [list(row["candidates"])]))
    makers = _bad_requests(rows[0], limits, max_new_tokens)
    out += [makers[i % len(makers)]() for i in range(n_bad)]
    rng.shuffle(out)
    return out


def send(url: str, body: bytes, timeout_s: float) -> tuple[int, bytes, float]:
    """POST a JSON `body`: (HTTP status, answer body, seconds); status 0 when the connection failed
    (the bench counts it as a server error)."""
    start = time.perf_counter()
    http = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as resp:
            status, answer = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, answer = err.code, err.read()
    except OSError as err:  # reset, refused, timed out: the server failed this request
        status, answer = 0, str(err).encode()
    return status, answer, time.perf_counter() - start


def _valid_rankings(body: bytes, candidates: list[list[int]]) -> bool:
    try:
        preds = json.loads(body)["predictions"]
        return len(preds) == len(candidates) and all(sorted(p["ranking"]) == sorted(c) for p, c in zip(preds, candidates, strict=True))
    except (ValueError, KeyError, TypeError):
        return False


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class LoadReport:
    """What a load run found: counts, failures (empty when it passed), latency (s) and throughput (requests/s)."""

    requests: int
    concurrency: int
    seconds: float
    throughput: float
    status_counts: dict[str, int]
    latency_good: dict[str, float]
    latency_all: dict[str, float]
    failures: list[str]
    alive_after: bool

    @property
    def passed(self) -> bool:
        return not self.failures and self.alive_after

    def text(self) -> str:
        lat = lambda d: f"p50 {d['p50']:.3f} s, p95 {d['p95']:.3f} s, p99 {d['p99']:.3f} s"  # noqa: E731
        lines = [
            f"{self.requests} requests, {self.concurrency} at a time, in {self.seconds:.1f} s: {self.throughput:.2f} requests/s",
            "statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.status_counts.items())),
            f"latency of good requests: {lat(self.latency_good)}",
            f"latency of all requests:  {lat(self.latency_all)}",
            f"server alive afterwards: {'yes' if self.alive_after else 'NO'}",
        ]
        lines += [f"FAILED: {f}" for f in self.failures[:20]] + ([f"... and {len(self.failures) - 20} more"] if len(self.failures) > 20 else [])
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


def run_load(base_url: str, requests: list[Request], concurrency: int, timeout_s: float = 120.0) -> LoadReport:
    """Send `requests` to `base_url`/invocations, `concurrency` at a time, and judge every answer."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda r: send(f"{base_url}/invocations", r.body, timeout_s), requests))
    seconds = time.perf_counter() - start
    failures = []
    for i, (req, (status, body, _)) in enumerate(zip(requests, results, strict=True)):
        if status == 0 or status >= 500:
            failures.append(f"request {i} ({req.kind}): {'no answer' if status == 0 else f'HTTP {status}'}: {body[:200]!r}")
        elif status not in req.expect:
            failures.append(f"request {i} ({req.kind}): HTTP {status}, expected {req.expect}: {body[:200]!r}")
        elif req.kind == "good" and not _valid_rankings(body, req.candidates):
            failures.append(f"request {i} (good): the answer is not a permutation of the candidates per row: {body[:200]!r}")
    try:
        with urllib.request.urlopen(f"{base_url}/ping", timeout=30) as resp:
            alive = resp.status == 200
    except OSError:
        alive = False
    good = [t for req, (_, _, t) in zip(requests, results, strict=True) if req.kind == "good"]
    every = [t for _, _, t in results]
    pct = lambda v: {f"p{q}": round(_percentile(v, q), 4) for q in (50, 95, 99)}  # noqa: E731
    return LoadReport(
        requests=len(requests),
        concurrency=concurrency,
        seconds=round(seconds, 2),
        throughput=round(len(requests) / seconds, 2) if seconds else 0.0,
        status_counts=dict(Counter(str(s) for s, _, _ in results)),
        latency_good=pct(good),
        latency_all=pct(every),
        failures=failures,
        alive_after=alive,
    )


def stop(proc: subprocess.Popen) -> None:
    """Stop a server started in its own session: SIGTERM its process group, SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def bench_serve(
    model_dir: Path,
    rows: list[dict[str, Any]],
    *,
    requests: int = 400,
    concurrency: int = 8,
    bad_share: float = 0.2,
    max_new_tokens: int = 16,
    seed: int = 0,
    log_path: Path | None = None,
) -> LoadReport:
    """Serve the pyfunc model in `model_dir` with `gr2 serve` on a free loopback port and load-test it.

    `rows` are good request rows (history, candidates, and evidence when the
    model needs it). The server is stopped by its pid whatever happens.
    """
    from mlflow.models import Model

    config = Model.load(str(model_dir)).flavors.get("python_function", {}).get("model_config") or {}
    limits = ServeLimits.from_model_config(config)
    with served(model_dir, log_path) as (url, proc):
        mix = request_mix(rows, limits, requests, bad_share, max_new_tokens, seed)
        report = run_load(url, mix, concurrency)
        report.alive_after = report.alive_after and proc.poll() is None
        return report


@contextmanager
def served(model_dir: Path, log_path: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`gr2 serve model_dir` on a free loopback port: yields (its base URL, once /ping answers; the process),
    and stops it by its process group whatever happens. RuntimeError when it exits or stays silent."""
    port = free_port()
    gr2 = Path(sys.executable).parent / "gr2"
    if log_path:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(gr2), "serve", str(model_dir), "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gr2 serve exited with {proc.returncode} before answering" + (f"; see {log_path}" if log_path else ""))
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gr2 serve did not answer within {STARTUP_TIMEOUT_S} s") from None
                time.sleep(0.3)
        yield url, proc
    finally:
        stop(proc)
        if log_path:
            out.close()


def report_dict(report: LoadReport) -> dict[str, Any]:
    """The report as JSON-ready data (with `passed`)."""
    return {**asdict(report), "passed": report.passed}
