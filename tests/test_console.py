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
