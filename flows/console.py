"""What `gr2 run` prints, and what `gr2 status` reports.

The console of a pipeline run holds one line when each stage starts and one
when it ends (status, seconds, headline metrics), our own warnings, and, on a
failure, the stage's last lines and the log's path. Everything else (the
stages' output as DVC streams it, Prefect's flow and task logs, MLflow's and
DVC's chatter) goes to `logs/<run>.log` in the workspace; `-v` puts it back on
the console. httpx logs every Prefect API call at INFO: those lines are dropped
unless `-v`.

While a stage runs, one live line shows its progress: the pipeline position,
the stage's time so far, and the stage's current tqdm bar (what it counts, a
small bar, n/total, rate, ETA), parsed from the bar lines the stage already
prints (`parse_tqdm`; flows/dvc_stages.repro feeds them in). On a terminal the
line is redrawn in place and wiped before any other console line; anywhere else
(a file, CI, a pipe) the same text is printed as an ordinary line at most once
a minute (`PROGRESS_PRINT_EVERY_S`), never one line per refresh.

The stage lines are records of the `gr2.console` logger, so they land in the
log file and in Prefect's logs as well, and a caller that never set up this
console (tests, `gr2 schedule run`) still sees them as ordinary INFO records.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tasks.report import read_json, stage_headline

CONSOLE_LOGGER = "gr2.console"
LOG_DIR = Path("logs")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# Loggers that speak for the tools, not for the pipeline: kept off the quiet console even at WARNING
# (a failed task's traceback from Prefect repeats what the failure summary says).
TOOL_LOGGERS = (
    "prefect", "httpx", "httpcore", "mlflow", "alembic", "urllib3", "dvc", "uvicorn", "fastapi", "git",
    "py.warnings",  # libraries' warnings.warn (e.g. MLflow's pyfunc signature notes), captured into logging
)  # fmt: skip
CHATTY = ("httpx", "httpcore")  # INFO on every HTTP request to Prefect's API

console_log = logging.getLogger(CONSOLE_LOGGER)


# The pipeline's own code (not its tests, not the venv).
OWN_CODE = tuple(Path(__file__).resolve().parents[1] / d for d in ("flows", "tasks", "gr2model"))


class _QuietConsole(logging.Filter):
    """Pass the stage lines, and warnings of the pipeline's own code; drop the rest.

    Our code also warns through Prefect's run logger (e.g. "MLflow run ... marked
    KILLED" in the flow), whose records carry a tool logger's name: what counts
    is where the call is, so a warning from a file of this project passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == CONSOLE_LOGGER or record.name.startswith(CONSOLE_LOGGER + "."):
            return True
        if record.levelno < logging.WARNING:
            return False
        where = Path(record.pathname).resolve()
        if any(where.is_relative_to(d) for d in OWN_CODE):
            return True
        return not any(record.name == t or record.name.startswith(t + ".") for t in TOOL_LOGGERS)


@dataclass
class RunLog:
    """The log of one `gr2 run`: where it is and the handlers to take down afterwards."""

    path: Path
    handlers: list[logging.Handler]
    saved_levels: dict[str, int]
    replaced: list[logging.Handler]  # the console handlers it took off the root logger
    # MLflow's own stderr handlers (it does not propagate to the root logger): taken off while quiet.
    mlflow_handlers: list[logging.Handler] | None = None
    env: dict[str, str | None] | None = None  # environment variables it set, with their old values

    def close(self) -> None:
        """Remove the handlers this run added; put back the ones it replaced and the levels it changed."""
        global _live
        if _live is not None:
            _live.end()
            _live = None
        root = logging.getLogger()
        for h in self.handlers:
            root.removeHandler(h)
            h.close()
        for h in self.replaced:
            root.addHandler(h)
        for name, level in self.saved_levels.items():
            logging.getLogger(name).setLevel(level)
        if self.mlflow_handlers is not None:
            mlflow_log = logging.getLogger("mlflow")
            mlflow_log.propagate = False
            for h in self.mlflow_handlers:
                mlflow_log.addHandler(h)
            logging.captureWarnings(False)
        for key, old in (self.env or {}).items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def setup_run_logging(
    root: Path, verbose: bool = False, stream: TextIO | None = None, run_name: str | None = None, live: bool | None = None
) -> RunLog:
    """Send every record to `<root>/logs/<run>.log` and only the stage lines and our warnings to the console.

    The root logger's existing console handlers are replaced by one that writes
    to `stream` (default stderr) through the quiet filter, or unfiltered when
    `verbose`. The running stage's progress goes to the same stream (`LiveProgress`),
    redrawn in place when `live` (default: the stream is a terminal), else printed
    once a minute. Returns the RunLog; `close()` undoes it.
    """
    run_name = run_name or time.strftime("%Y%m%d-%H%M%S")
    path = root / LOG_DIR / f"{run_name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    top = logging.getLogger()
    # basicConfig's stderr handler (gr2's main) is replaced by the console below; handlers
    # writing elsewhere (files, a test's capture) are left alone.
    replaced = [h for h in top.handlers if type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.stdout)]
    for h in replaced:
        top.removeHandler(h)
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(LOG_FORMAT))
    global _live
    stream = stream or sys.stderr
    _live = LiveProgress(stream, tty=stream.isatty() if live is None else live)
    console = _ConsoleHandler(stream, _live)
    if verbose:
        console.setFormatter(logging.Formatter(LOG_FORMAT))
    else:
        console.setFormatter(logging.Formatter("%(message)s"))
        console.addFilter(_QuietConsole())
    top.addHandler(file_handler)
    top.addHandler(console)
    saved = {name: logging.getLogger(name).level for name in (*CHATTY, CONSOLE_LOGGER, "")}
    top.setLevel(min(top.level or logging.INFO, logging.INFO))
    console_log.setLevel(logging.INFO)
    run_log = RunLog(path, [file_handler, console], saved, replaced)
    if not verbose:
        for name in CHATTY:
            logging.getLogger(name).setLevel(logging.WARNING)
        _quiet_mlflow(run_log)
    return run_log


def _quiet_mlflow(run_log: RunLog) -> None:
    """Route MLflow's records, and libraries' warnings, through the root logger (the file; the console drops them).

    `import mlflow` gives its logger its own stderr handler and stops propagation,
    so its INFO lines ("Creating initial MLflow database tables...") would bypass
    the quiet console; its artifact downloads draw tqdm bars on stderr.
    """
    import mlflow  # noqa: F401  (configures its loggers now, not after we have moved them)

    mlflow_log = logging.getLogger("mlflow")
    run_log.mlflow_handlers = list(mlflow_log.handlers)
    for h in run_log.mlflow_handlers:
        mlflow_log.removeHandler(h)
    mlflow_log.propagate = True
    logging.captureWarnings(True)
    run_log.env = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")}
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"


# --- the live progress line -----------------------------------------------------------------------

PROGRESS_PRINT_EVERY_S = 60.0  # off a terminal: at most one progress line a minute per stage
REDRAW_EVERY_S = 0.2  # on a terminal: redraw at most 5 times a second (tqdm refreshes up to 10)
TICK_S = 1.0  # on a terminal: redraw at least once a second, so the stage's clock moves and a bar's last state shows
BAR_WIDTH = 20

_NUM = r"[\d.]+[kMGTPEZY]?"  # tqdm's n and total, with unit_scale's suffixes
_TAIL = r"\[(?P<elapsed>[\d:]+)(?:<(?P<remaining>[\d:]+|\?))?,\s*(?P<rate>[^,\]]+)(?:,\s*(?P<postfix>[^\]]*))?\]\s*$"
# tqdm's default bar, known total: "dapo:  45%|████▌     | 45/100 [00:10<00:12,  4.50it/s, loss=1.2]"
_TQDM_TOTAL = re.compile(r"^(?:(?P<desc>.*?):\s*)?(?P<pct>\d{1,3})%\|[^|]*\|\s*(?P<n>" + _NUM + r")/(?P<total>" + _NUM + r")\s*" + _TAIL)
# unknown total: "next-item valid: 3batch [00:00, 36.8batch/s]"
_TQDM_COUNT = re.compile(r"^(?:(?P<desc>.*?):\s*)?(?P<n>" + _NUM + r")(?P<unit>[A-Za-z]*)\s*" + _TAIL)


@dataclass(frozen=True)
class BarState:
    """One state of a stage's tqdm bar, as printed (strings kept as tqdm formatted them)."""

    desc: str
    n: str
    total: str | None  # None: the bar counts without a total
    percent: int | None
    elapsed: str
    remaining: str | None  # "00:12"; None when unknown
    rate: str  # "4.50it/s"


def parse_tqdm(line: str) -> BarState | None:
    """A tqdm bar line (default format, with or without a total) as a BarState; None for any other line."""
    line = line.strip()
    m = _TQDM_TOTAL.match(line)
    if m:
        return BarState(
            desc=(m["desc"] or "").strip(), n=m["n"], total=m["total"], percent=int(m["pct"]), elapsed=m["elapsed"],
            remaining=None if m["remaining"] in (None, "?") else m["remaining"], rate=m["rate"].strip(),
        )  # fmt: skip
    m = _TQDM_COUNT.match(line)
    if m:
        return BarState(desc=(m["desc"] or "").strip(), n=m["n"], total=None, percent=None, elapsed=m["elapsed"], remaining=None, rate=m["rate"].strip())
    return None


def _clock(seconds: float) -> str:
    """1:23, 1:02:03."""
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def progress_text(
    position: int, total: int, stage: str, stage_seconds: float, bar: BarState | None, last_s: float | None = None
) -> str:
    """`[5/11] sft 1:23 of ~32:10 | dapo [█████████░░░░░░░░░░░] 45% 45/100 4.50it/s ETA 00:12`

    The bar's ETA is its own (a stage may run several bars in turn); `last_s`, the time
    the stage took when it last ran here, gives the stage's whole length ("of ~32:10").
    """
    head = f"[{position}/{total}] {stage} {_clock(stage_seconds)}" + (f" of ~{_clock(last_s)}" if last_s else "")
    if bar is None:
        return head
    parts = [bar.desc] if bar.desc else []
    if bar.percent is not None and bar.total is not None:
        filled = round(BAR_WIDTH * min(bar.percent, 100) / 100)
        parts += ["[" + "█" * filled + "░" * (BAR_WIDTH - filled) + "]", f"{bar.percent}%", f"{bar.n}/{bar.total}"]
    else:
        parts.append(bar.n)
    parts.append(bar.rate)
    if bar.remaining is not None:
        parts.append(f"ETA {bar.remaining}")
    return f"{head} | {' '.join(parts)}"


class LiveProgress:
    """The running stage's progress line on the console stream.

    On a terminal (`tty`) the line is redrawn in place (carriage return, erase to
    the end of the line) and `hide`/`show` wipe and redraw it around any other
    console output, so log lines never land in the middle of it. Elsewhere the
    same text goes out through the `gr2.console` logger at most every `every_s`
    seconds of a stage (so into the log file as well), never once per refresh.
    On a terminal a ticker thread also redraws every `tick_s` seconds (None: no
    ticker): an update that came within REDRAW_EVERY_S of the last draw (often a
    short bar's final state) is shown, and the stage's clock moves while it
    prints no bar. `clock` is injectable so tests need no sleeping.
    """

    def __init__(
        self, stream: TextIO, tty: bool, *, every_s: float = PROGRESS_PRINT_EVERY_S, tick_s: float | None = TICK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.stream = stream
        self.tty = tty
        self.every_s = every_s
        self.tick_s = tick_s
        self.clock = clock
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._stage: tuple[int, int, str] | None = None
        self._last_s: float | None = None
        self._started = 0.0
        self._last_print = 0.0
        self._last_draw = float("-inf")
        self._bar: BarState | None = None
        self._drawn = ""  # the text now on the terminal's last line ("" when none)

    def begin(self, position: int, total: int, stage: str, last_s: float | None = None) -> None:
        """A stage starts; `last_s`: how long it took when it last ran (None: unknown)."""
        with self._lock:
            self._stage = (position, total, stage)
            self._last_s = last_s
            self._started = self._last_print = self.clock()
            self._bar = None
            if self.tty and self.tick_s and self._ticker is None:
                self._stop.clear()
                self._ticker = threading.Thread(target=self._tick, name="gr2-progress", daemon=True)
                self._ticker.start()

    def end(self) -> None:
        with self._lock:
            self.hide()
            self._stage = None
            self._bar = None
            ticker, self._ticker = self._ticker, None
        if ticker is not None:
            self._stop.set()
            ticker.join()

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                if self._stage is not None:
                    self._last_draw = self.clock()
                    self._draw(self.text())

    def text(self) -> str:
        """The current progress text; "" between stages."""
        with self._lock:
            if self._stage is None:
                return ""
            position, total, stage = self._stage
            return progress_text(position, total, stage, self.clock() - self._started, self._bar, self._last_s)

    def update(self, bar: BarState) -> None:
        """A new state of the stage's bar: redraw (terminal) or print if a minute has passed (elsewhere)."""
        to_print = ""
        with self._lock:
            if self._stage is None:
                return
            self._bar = bar
            now = self.clock()
            if self.tty:
                if now - self._last_draw >= REDRAW_EVERY_S:
                    self._last_draw = now
                    self._draw(self.text())
                return
            if now - self._last_print >= self.every_s:
                self._last_print = now
                to_print = self.text()
        if to_print:
            # Outside the lock: the console handler takes it again (hide/show) under its own lock.
            console_log.info("%s", to_print)

    def _draw(self, text: str) -> None:
        width = shutil.get_terminal_size((100, 24)).columns
        text = text[: max(10, width - 1)]  # one terminal row: a wrapped line could not be redrawn in place
        self.stream.write("\r" + text + "\x1b[K")
        self.stream.flush()
        self._drawn = text

    def hide(self) -> None:
        """Wipe the live line (terminal only) before other output."""
        with self._lock:
            if self.tty and self._drawn:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._drawn = ""

    def show(self) -> None:
        """Redraw the live line (terminal only) after other output."""
        with self._lock:
            if self.tty and self._stage is not None and (self._bar is not None or self._ticker is not None):
                self._draw(self.text())


_live: LiveProgress | None = None  # the live line of the `gr2 run` in this process, if any


class _ConsoleHandler(logging.StreamHandler):
    """The console's handler: wipes the live progress line before a record and redraws it after."""

    def __init__(self, stream: TextIO, live: LiveProgress) -> None:
        super().__init__(stream)
        self.live = live

    def emit(self, record: logging.LogRecord) -> None:
        self.live.hide()
        super().emit(record)
        self.live.show()


def stage_progress(bar: BarState) -> None:
    """Pass a stage's bar state to the live line of this process's `gr2 run` (nothing without one)."""
    if _live is not None:
        _live.update(bar)


# --- the stage lines ------------------------------------------------------------------------------


def stage_started(position: int, total: int, stage: str) -> None:
    """`[5/11] sft ...`"""
    console_log.info("[%d/%d] %s ...", position, total, stage)


def stage_finished(position: int, total: int, summary: Mapping[str, Any], root: Path, seconds: float) -> None:
    """`[5/11] sft ran in 123.4 s: loss 0.0975, valid loss 0.0803` (skipped: the metrics on disk)."""
    stage = summary["stage"]
    head = stage_headline(root, stage, summary.get("metrics"))
    status = "ran" if summary.get("status") == "ran" else "skipped (up to date)"
    console_log.info("[%d/%d] %s %s in %.1f s%s", position, total, stage, status, seconds, f": {head}" if head else "")


def stage_failed(position: int, total: int, stage: str, seconds: float) -> None:
    """`[5/11] sft FAILED after 12.3 s` (the cause and the log's path follow from the caller)."""
    console_log.error("[%d/%d] %s FAILED after %.1f s", position, total, stage, seconds)


@contextmanager
def stage_lines(position: int, total: int, stage: str, root: Path) -> Iterator[dict[str, Any]]:
    """Start line now, end line when the body has put the stage's summary in the yielded dict."""
    stage_started(position, total, stage)
    start = time.perf_counter()
    out: dict[str, Any] = {}
    live = _live
    if live is not None:
        # The stage's own time on its last run here (metrics/<stage>.json), as the scale of its whole length.
        last = (read_json(root / "metrics" / f"{stage}.json") or {}).get("seconds")
        live.begin(position, total, stage, float(last) if isinstance(last, (int, float)) and last > 0 else None)
    try:
        yield out
    except BaseException:
        if live is not None:
            live.end()
        stage_failed(position, total, stage, time.perf_counter() - start)
        raise
    if live is not None:
        live.end()
    if "summary" in out:
        stage_finished(position, total, out["summary"], root, time.perf_counter() - start)


# --- gr2 status ---------------------------------------------------------------------------------


def status_rows(root: Path, stages: list[str], changed: set[str] | None) -> list[dict[str, Any]]:
    """Per stage: whether its metrics exist, when they were written, its headline and (when
    `changed` is known) whether DVC would rerun it."""
    rows = []
    for stage in stages:
        path = root / "metrics" / f"{stage}.json"
        metrics = read_json(path)
        rows.append(
            {
                "stage": stage,
                "metrics": path.exists(),
                "written": time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime)) if path.exists() else "",
                "seconds": (metrics or {}).get("seconds"),
                "headline": stage_headline(root, stage, metrics),
                "dvc": None if changed is None else ("out of date" if stage in changed else "up to date"),
            }
        )
    return rows


def status_table(rows: list[dict[str, Any]]) -> str:
    """`gr2 status` as aligned text."""
    lines = [f"{'stage':<13}{'dvc':<13}{'written':<18}{'seconds':>9}  headline"]
    for r in rows:
        secs = f"{r['seconds']:.0f}" if isinstance(r["seconds"], (int, float)) else "-"
        lines.append(
            f"{r['stage']:<13}{(r['dvc'] or 'not checked'):<13}{(r['written'] or 'no metrics'):<18}{secs:>9}  {r['headline'] or '-'}"
        )
    return "\n".join(lines)
