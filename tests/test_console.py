"""The quiet console of `gr2 run`: stage lines and our warnings on the console, everything in logs/<run>.log; `gr2 status`."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from flows.console import CONSOLE_LOGGER, setup_run_logging, stage_lines, status_rows, status_table


def _emit_mix() -> None:
    logging.getLogger("httpx").info("HTTP Request: POST http://127.0.0.1:1234/api/logs/ 201")
    logging.getLogger("prefect.flow_runs").info("Beginning flow run 'x'")
    logging.getLogger("prefect.task_runs").error("Task run failed with a traceback")
    logging.getLogger("flows.dvc").info("[sft] step 10 loss 1.2")
    logging.getLogger("flows.pipeline").warning("MLflow run abc was still RUNNING: marked KILLED")


def test_quiet_console_and_full_log_file(tmp_path: Path) -> None:
    out = io.StringIO()
    run_log = setup_run_logging(tmp_path, stream=out, run_name="r1")
    try:
        with stage_lines(2, 11, "retrieve", tmp_path) as lines:
            _emit_mix()
            lines["summary"] = {"stage": "retrieve", "status": "ran", "metrics": {"full_ranking": {"test": {"prerank": {"recall@10": 0.0928}}}}}
    finally:
        run_log.close()
    console = out.getvalue().splitlines()
    assert console[0] == "[2/11] retrieve ..."
    assert console[1] == "MLflow run abc was still RUNNING: marked KILLED"
    assert console[2].startswith("[2/11] retrieve ran in ") and console[2].endswith(" s: R@10 0.0928")
    assert len(console) == 3  # no httpx, no Prefect, no stage output
    log = (tmp_path / "logs/r1.log").read_text()
    assert run_log.path == tmp_path / "logs/r1.log"
    for line in ("Beginning flow run", "Task run failed", "[sft] step 10 loss 1.2", "[2/11] retrieve ran"):
        assert line in log
    assert "HTTP Request" not in log
    # closed: the handlers are gone and httpx speaks again
    assert not any(h in logging.getLogger().handlers for h in run_log.handlers)
    assert logging.getLogger("httpx").level == logging.NOTSET


def test_mlflow_lines_and_library_warnings_stay_off_the_quiet_console(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow logs through its own stderr handler and does not propagate: the quiet run routes it to the file."""
    import os
    import warnings

    import mlflow  # noqa: F401  (its loggers configured as a real run has them)

    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    mlflow_log = logging.getLogger("mlflow")
    before = list(mlflow_log.handlers)
    out = io.StringIO()
    run_log = setup_run_logging(tmp_path, stream=out, run_name="r3")
    try:
        assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "false"
        logging.getLogger("mlflow.store.db.utils").warning("Creating initial MLflow database tables...")
        warnings.warn("An input example was not provided", UserWarning, stacklevel=1)
    finally:
        run_log.close()
    assert out.getvalue() == ""
    log = (tmp_path / "logs/r3.log").read_text()
    assert "Creating initial MLflow database tables" in log and "An input example was not provided" in log
    # closed: MLflow's own handlers and setting are back, and so is the environment
    assert mlflow_log.handlers == before and mlflow_log.propagate is False
    assert "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ


def test_our_warnings_pass_under_any_logger_name_and_stage_warnings_are_found() -> None:
    """The flow warns through Prefect's run logger: where the call is decides, not the logger's name."""
    from flows.console import OWN_CODE, _QuietConsole
    from flows.dvc_stages import STAGE_WARNING

    def record(name: str, path: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord(name, level, path, 1, "MLflow run x was still RUNNING: marked KILLED", None, None)

    quiet = _QuietConsole()
    ours = str(OWN_CODE[0] / "pipeline.py")
    assert quiet.filter(record("prefect.flow_runs", ours))
    assert not quiet.filter(record("prefect.flow_runs", ours, logging.INFO))
    assert not quiet.filter(record("prefect.flow_runs", "/venv/lib/python3.11/site-packages/prefect/engine.py"))
    assert not quiet.filter(record("prefect.task_runs", __file__))  # tests are not the pipeline
    line = "2026-12-05 17:52:28,662 sft tasks.sft WARNING resuming from the state saved after step 12 (/w/.gr2/x)"
    assert STAGE_WARNING.match(line).group(1).startswith("resuming from the state saved after step 12")
    assert STAGE_WARNING.match("2026-12-05 17:52:28,662 sft accelerate.accelerator WARNING x") is None
    assert STAGE_WARNING.match("2026-12-05 17:52:28,662 sft tasks.sft INFO x") is None


def test_verbose_console_shows_everything(tmp_path: Path) -> None:
    out = io.StringIO()
    run_log = setup_run_logging(tmp_path, verbose=True, stream=out, run_name="r2")
    try:
        _emit_mix()
    finally:
        run_log.close()
    text = out.getvalue()
    for line in ("HTTP Request", "Beginning flow run", "[sft] step 10", "marked KILLED"):
        assert line in text


def test_failed_and_skipped_stage_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=CONSOLE_LOGGER)
    with pytest.raises(RuntimeError, match="boom"):
        with stage_lines(5, 11, "sft", tmp_path):
            raise RuntimeError("stage 'sft' failed (exit 1):\nboom")
    with stage_lines(1, 11, "prepare", tmp_path) as lines:
        lines["summary"] = {"stage": "prepare", "status": "skipped", "metrics": {"users": 1500, "items": 900}}
    msgs = [r.getMessage() for r in caplog.records if r.name == CONSOLE_LOGGER]
    assert msgs[0] == "[5/11] sft ..." and msgs[1].startswith("[5/11] sft FAILED after ")
    assert msgs[3].startswith("[1/11] prepare skipped (up to date) in ") and msgs[3].endswith("users 1,500, items 900")


def test_status_rows_and_table(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/sft.json").write_text(json.dumps({"final_train_loss": 0.0975, "valid": {"valid_loss": 0.0803}, "seconds": 1930.9}))
    rows = status_rows(tmp_path, ["prepare", "sft"], {"prepare"})
    assert rows[0] == {"stage": "prepare", "metrics": False, "written": "", "seconds": None, "headline": "", "dvc": "out of date"}
    assert rows[1]["metrics"] and rows[1]["dvc"] == "up to date" and rows[1]["headline"] == "loss 0.0975, valid loss 0.0803"
    table = status_table(rows).splitlines()
    assert table[1].split()[:4] == ["prepare", "out", "of", "date"] and "no metrics" in table[1]
    assert table[2].split()[0] == "sft" and "1931" in table[2]
    assert "not checked" in status_table(status_rows(tmp_path, ["sft"], None))


# --- the live progress line ---------------------------------------------------------------------


def _tqdm_lines() -> list[str]:
    """Real tqdm output (default format, known and unknown totals), split as flows/dvc_stages reads it."""
    from tqdm import tqdm

    buf = io.StringIO()
    for _ in tqdm(range(4), desc="dapo", file=buf, mininterval=0):
        pass
    bar = tqdm(total=100, initial=40, desc="sft", file=buf, mininterval=0)
    bar.update(5)
    bar.set_postfix(loss=1.23)
    bar.close()
    for _ in tqdm(iter(range(3)), desc="next-item valid", unit="batch", file=buf, mininterval=0):
        pass
    for _ in tqdm(range(3000), desc="encode", file=buf, mininterval=0, unit_scale=True, miniters=1000):
        pass
    return [part.strip() for line in buf.getvalue().split("\n") for part in line.split("\r") if part.strip()]


def test_parse_tqdm_reads_real_bars_and_nothing_else() -> None:
    from flows.console import parse_tqdm

    bars = [b for b in map(parse_tqdm, _tqdm_lines())]
    assert all(b is not None for b in bars)
    dapo = [b for b in bars if b.desc == "dapo"]
    assert dapo[0].n == "0" and dapo[0].total == "4" and dapo[0].percent == 0 and dapo[0].remaining is None
    assert dapo[-1].n == "4" and dapo[-1].percent == 100 and dapo[-1].rate.endswith("it/s") and dapo[-1].remaining == "00:00"
    sft = [b for b in bars if b.desc == "sft"][-1]
    assert (sft.n, sft.total, sft.percent) == ("45", "100", 45)  # the postfix (loss=1.23) is not the rate
    assert "loss" not in sft.rate
    counted = [b for b in bars if b.desc == "next-item valid"][-1]
    assert counted.n == "3" and counted.total is None and counted.rate.endswith("batch/s")
    assert [b for b in bars if b.desc == "encode"][-1].total == "3.00k"
    for other in ("2026-12-05 17:52:28,662 sft tasks.sft INFO step 10 loss 1.2", "[sft] 45% done", "Running stage 'sft':"):
        assert parse_tqdm(other) is None


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_live_line_on_a_terminal_is_redrawn_in_place_around_log_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.console as console
    from flows.console import BarState, stage_progress

    monkeypatch.setenv("COLUMNS", "100")  # the line is cut to the terminal's width; pytest-xdist's workers see another

    out = io.StringIO()
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/sft.json").write_text('{"seconds": 1930.4}')  # the last run of sft here
    run_log = setup_run_logging(tmp_path, stream=out, run_name="t1", live=True)
    clock = _Clock()
    console._live.clock = clock
    console._live.tick_s = None  # no ticker thread: every draw below comes from an update or a log line
    try:
        with stage_lines(5, 11, "sft", tmp_path) as lines:
            clock.t += 83
            stage_progress(BarState("dapo", "45", "100", 45, "00:10", "00:12", "4.50it/s"))
            logging.getLogger("flows.pipeline").warning("resuming from step 12")
            clock.t += 0.01  # within the redraw interval: not drawn again
            stage_progress(BarState("dapo", "46", "100", 46, "00:10", "00:12", "4.50it/s"))
            lines["summary"] = {"stage": "sft", "status": "ran", "metrics": {}}
    finally:
        run_log.close()
    live = "[5/11] sft 1:23 of ~32:10 | dapo [" + "█" * 9 + "░" * 11 + "] 45% 45/100 4.50it/s ETA 00:12"
    text = out.getvalue()
    # drawn, wiped for the warning, drawn again below it, wiped before the end line
    assert text == (
        "[5/11] sft ...\n"
        f"\r{live}\x1b[K"
        "\r\x1b[Kresuming from step 12\n"
        f"\r{live}\x1b[K"
        "\r\x1b[K[5/11] sft ran in " + text.split("[5/11] sft ran in ")[1]
    )
    assert "46/100" not in text
    assert "dapo" not in (tmp_path / "logs/t1.log").read_text()  # the terminal's live line is not logged


def test_progress_off_a_terminal_is_one_line_a_minute(tmp_path: Path) -> None:
    import flows.console as console
    from flows.console import BarState, stage_progress

    out = io.StringIO()
    run_log = setup_run_logging(tmp_path, stream=out, run_name="t2")  # a StringIO is no terminal
    clock = _Clock()
    console._live.clock = clock
    try:
        with stage_lines(3, 11, "traces", tmp_path) as lines:
            for seconds in (1, 30, 59, 61, 62, 100, 125):  # a bar state at each of these seconds into the stage
                clock.t = 1000.0 + seconds
                stage_progress(BarState("teacher", str(seconds), "200", seconds // 2, "00:01", "03:00", "1.00it/s"))
            lines["summary"] = {"stage": "traces", "status": "ran", "metrics": {}}
        stage_progress(BarState("teacher", "1", "200", 0, "00:01", None, "1.00it/s"))  # between stages: nothing
    finally:
        run_log.close()
    console_lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert console_lines[1] == "[3/11] traces 1:01 | teacher [" + "█" * 6 + "░" * 14 + "] 30% 61/200 1.00it/s ETA 03:00"
    assert console_lines[2].startswith("[3/11] traces 2:05 | teacher") and "125/200" in console_lines[2]
    assert len(console_lines) == 4 and console_lines[3].startswith("[3/11] traces ran in ")
    assert "[3/11] traces 1:01 | teacher" in (tmp_path / "logs/t2.log").read_text()


def test_repro_feeds_the_stage_bars_to_the_live_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flows/dvc_stages.repro reads a stage's output as DVC streams it: every bar state reaches the live line."""
    import subprocess
    import sys

    import flows.console as console
    import flows.dvc_stages as dvc_stages

    script = (
        "import sys\nfrom tqdm import tqdm\nprint('2026-12-05 17:52:28,662 sft tasks.sft INFO starting', file=sys.stderr, flush=True)\n"
        "for _ in tqdm(range(5), desc='sft', mininterval=0): pass\n"
    )
    real_popen = subprocess.Popen
    monkeypatch.setattr(dvc_stages.subprocess, "Popen", lambda cmd, **kw: real_popen([sys.executable, "-c", script], **kw))
    seen: list[console.BarState] = []
    monkeypatch.setattr(dvc_stages, "stage_progress", seen.append)
    dvc_stages.repro(tmp_path, "sft")
    assert [(b.desc, b.n, b.total) for b in seen][-1] == ("sft", "5", "5")
    assert {b.n for b in seen} >= {"0", "1", "2", "3", "4", "5"}


def test_ticker_redraws_the_latest_state_and_stops_with_the_stage(tmp_path: Path) -> None:
    """On a terminal an update within the redraw interval is drawn by the ticker, not lost."""
    import threading

    from flows.console import BarState, LiveProgress

    class _Stream(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.drawn = threading.Event()

        def write(self, s: str) -> int:
            if "2/2" in s:
                self.drawn.set()
            return super().write(s)

    out = _Stream()
    live = LiveProgress(out, tty=True, tick_s=0.01)
    live.begin(8, 11, "cft")
    live.update(BarState("cft", "1", "2", 50, "00:01", "00:01", "1.00it/s"))
    live.update(BarState("cft", "2", "2", 100, "00:02", "00:00", "1.00it/s"))  # within REDRAW_EVERY_S of the first
    assert out.drawn.wait(timeout=30), out.getvalue()
    live.end()
    assert live._ticker is None and out.getvalue().endswith("\r\x1b[K")
    after = out.getvalue()
    live.update(BarState("cft", "2", "2", 100, "00:02", "00:00", "1.00it/s"))  # between stages: nothing drawn
    assert out.getvalue() == after
