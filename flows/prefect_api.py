"""Prefect's temporary local API, started so that it never outlives the command that started it.

With no PREFECT_API_URL, Prefect starts a temporary API server (a `uvicorn`
subprocess on a loopback port) the first time a flow needs it, and stops it
from an `atexit` hook. A SIGKILLed `gr2 run` runs no hook, so the server was
left listening as an orphan. `temporary_api` starts that same server itself
(Prefect reuses the instance: `SubprocessASGIServer()` is one object per port
argument, and Prefect asks for the one without a port) and guards it twice:

- a watchdog (a tiny `sh` loop in its own session) stops the server within
  about a second of its parent's death;
- a record in `<root>/.gr2/prefect-api/<pid>.json` lets the next command of the
  workspace stop a server whose parent and watchdog both died
  (`stop_orphan_apis`), checking by start time and command line that the pid
  is still that server before signalling it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.common import write_json_atomic
from tasks.tracking import process_alive, process_start

log = logging.getLogger("flows.prefect_api")

STATE_DIR = ".gr2/prefect-api"
# Seconds the temporary API may take to answer (or PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
# when larger). It answers in about 10 s on an idle 2-core machine; Prefect's own 20 s failed to
# start it with the test suite and a stage sharing the two cores.
STARTUP_TIMEOUT_S = 120
# In the server's command line (prefect/server/api/server.py, SubprocessASGIServer).
SERVER_MARK = "prefect.server.api.server:create_app"

# Polls once a second while both live; when the parent is gone, TERM, then KILL
# if the server has not stopped after 10 s. Arguments: parent pid, server pid.
_WATCHDOG = """
while kill -0 "$1" 2>/dev/null && kill -0 "$2" 2>/dev/null; do sleep 1; done
kill -0 "$1" 2>/dev/null && exit 0
kill -TERM "$2" 2>/dev/null || exit 0
i=0; while kill -0 "$2" 2>/dev/null && [ $i -lt 20 ]; do sleep 0.5; i=$((i+1)); done
kill -KILL "$2" 2>/dev/null; exit 0
"""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _terminate(pid: int, wait_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it still runs after `wait_s`."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while process_start(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if process_start(pid) is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_orphan_apis(root: Path, logger: logging.Logger | None = None) -> list[int]:
    """Stop the temporary APIs that dead earlier commands of this workspace left running; return their pids.

    A record whose owner still runs is left alone (another command at work).
    """
    logger = logger or log
    stopped = []
    for path in sorted((root / STATE_DIR).glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            owner, server = int(rec["owner_pid"]), int(rec["server_pid"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("%s: unreadable record of a temporary Prefect API (%s); removed", path, exc)
            path.unlink(missing_ok=True)
            continue
        if process_alive(owner, rec.get("owner_start")):
            continue
        if process_alive(server, rec.get("server_start")) and SERVER_MARK in _cmdline(server):
            logger.warning(
                "Prefect's temporary API %s (pid %d) outlived the command that started it (pid %d, gone): stopping it",
                rec.get("url"), server, owner,
            )  # fmt: skip
            _terminate(server)
            stopped.append(server)
        path.unlink(missing_ok=True)
    return stopped


def _watch(server_pid: int) -> subprocess.Popen:
    # Its own session: a Ctrl-C or a kill of our process group does not take the
    # watchdog down before it has done its work.
    return subprocess.Popen(
        ["/bin/sh", "-c", _WATCHDOG, "gr2-prefect-watchdog", str(os.getpid()), str(server_pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


@contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT held back in this thread for the body (a Ctrl-C meanwhile arrives when it
    ends). A process started in the body inherits the block, and a blocked signal stays
    blocked across exec: such a process never receives SIGINT."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _drain_api_logs(logger: logging.Logger) -> None:
    """Send the flow's queued log records now, while the server still listens: left to
    Prefect's exit hook they go out after `server.stop()` and end the command with
    "Error logging to API: All connection attempts failed"."""
    from prefect.logging.handlers import APILogWorker

    try:
        APILogWorker.drain_all(timeout=5)
    except Exception as exc:  # best effort: a lost log line must not fail the run
        logger.debug("Prefect API logs not drained: %s", exc)


@contextmanager
def temporary_api(root: Path, logger: logging.Logger | None = None) -> Iterator[str | None]:
    """Prefect's temporary API for the body, guarded so it dies with this process; yields its URL.

    Yields None (and starts nothing) when PREFECT_API_URL names a server: that
    server's life is not ours. Orphans of earlier commands are stopped first.
    """
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    logger = logger or log
    root = root.resolve()
    stop_orphan_apis(root, logger)
    if PREFECT_API_URL.value():
        yield None
        return
    server = SubprocessASGIServer()
    # A Ctrl-C goes to the terminal's whole foreground process group: the server would
    # die before the flow has recorded how the run ended, and the client would print a
    # screen of connection errors. So the server never gets SIGINT; it is stopped with
    # SIGTERM (`server.stop()`, the watchdog).
    with _sigint_blocked():
        server.start(timeout=max(STARTUP_TIMEOUT_S, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
    proc = server.server_process
    if proc is None:  # started and stopped by someone else already; nothing to guard
        yield server.api_url
        return
    record = root / STATE_DIR / f"{os.getpid()}.json"
    write_json_atomic(
        {
            "owner_pid": os.getpid(),
            "owner_start": process_start(os.getpid()),
            "server_pid": proc.pid,
            "server_start": process_start(proc.pid),
            "url": server.api_url,
        },
        record,
    )
    watchdog = _watch(proc.pid)
    try:
        yield server.api_url
    finally:
        _drain_api_logs(logger)
        server.stop()
        watchdog.terminate()
        watchdog.wait(timeout=10)
        record.unlink(missing_ok=True)
