"""What every stage module shares: reading its params section, atomic writes, logging, timing.

A stage is `run(config, paths) -> metrics` plus a thin `main()` that reads its
section of `params.yaml`; DVC calls `python -m tasks.<stage>` and the Prefect flow
runs the same command through DVC, so there is one way to run a stage.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError

from gr2model.bounds import FieldRangeError

STAGES: tuple[str, ...] = (
    "prepare",
    "retrieve",
    "traces",
    "midtrain",
    "sft",
    "ar_rl",
    "trajectories",
    "cft",
    "opd",
    "rl",
    "evaluate",
)
"""Every stage name of the pipeline, in pipeline order (the DVC graph is the authority on order)."""

PARAMS_FILE = "params.yaml"

C = TypeVar("C", bound=BaseModel)

# Ranges of the numeric params, carried in the schema (issue 16). Floats refuse NaN
# and infinities: NaN passes no bound check, so a NaN lr would only show as a NaN loss.
Count = Annotated[int, Field(ge=1)]
"""Sizes, steps, epochs, batch sizes: at least one."""
Cap = Annotated[int, Field(ge=0)]
"""Caps where 0 means "all" (or "off"): max_examples, max_users, ..."""
Seed = Annotated[int, Field(ge=0)]
"""numpy's generators refuse negative seeds."""
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""Learning rates, temperatures, pseudo-counts."""
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""Weights, bonuses, weight decay."""
Unit = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
"""Probabilities and confidence thresholds, both ends allowed."""
Penalty = Annotated[float, Field(le=0, allow_inf_nan=False)]
"""The reward of an invalid answer: a penalty, never a reward (gr2model.rewards.rerank_reward)."""
Fraction = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
"""A held-out share: 0 holds out nothing, 1 would leave nothing to train on."""


class ParamsError(ValueError):
    """A params.yaml problem; the message names the file and the offending field."""


class StageConfig(BaseModel):
    """Base of every stage's typed config: unknown keys are errors, not silently ignored."""

    model_config = {"extra": "forbid", "frozen": True}


def read_params(path: Path = Path(PARAMS_FILE)) -> dict[str, Any]:
    """The whole params file as a dict, with a clear error when it is missing or malformed."""
    if not path.exists():
        raise ParamsError(f"{path}: file not found (run from the project root)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of stage sections, got {type(data).__name__}")
    return data


def load_stage_config(stage: str, model: type[C], path: Path = Path(PARAMS_FILE)) -> C:
    """Validate the `stage` section of params.yaml into its typed config.

    Errors name the file and the dotted field, e.g. `params.yaml: retrieve.train.lr: ...`.
    """
    params = read_params(path)
    if stage not in params:
        raise ParamsError(f"{path}: no section '{stage}'")
    try:
        return model.model_validate(params[stage] or {})
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = (stage, *err["loc"])
            # A gr2model config dataclass fails in __post_init__, which pydantic reports at
            # the dataclass (`sft.train`); its FieldRangeError names the field inside it.
            inner = (err.get("ctx") or {}).get("error")
            if isinstance(inner, FieldRangeError):
                loc = (*loc, inner.field)
            field = ".".join(str(p) for p in loc)
            # pydantic's bound messages ("Input should be greater than 0") omit the value; add it.
            got = "" if inner is not None or isinstance(err.get("input"), (dict, list)) else f" (input {err.get('input')!r})"
            lines.append(f"{path}: {field}: {err['msg']}{got}")
        raise ParamsError("\n".join(lines)) from exc


def write_text_atomic(text: str, path: Path) -> None:
    """Write text to a temporary sibling and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(obj: Any, path: Path) -> None:
    """`obj` as indented JSON, written atomically (serialised first, so a bad object writes nothing)."""
    write_text_atomic(json.dumps(obj, indent=2) + "\n", path)


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `final` in one rename.

    On any error the temporary folder is removed and `final` is left as it was.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp.", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def setup_logging(stage: str) -> logging.Logger:
    """Log to stderr with timestamps; DVC and the Prefect task stream it."""
    logging.basicConfig(
        level=os.environ.get("GR2_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {stage} %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    return logging.getLogger(f"tasks.{stage}")


@contextmanager
def timed(log: logging.Logger, what: str, into: dict[str, float] | None = None, key: str | None = None) -> Iterator[None]:
    """Log how long `what` took; optionally store the seconds in `into[key]`."""
    start = time.perf_counter()
    log.info("%s ...", what)
    yield
    seconds = time.perf_counter() - start
    log.info("%s done in %.1f s", what, seconds)
    if into is not None and key is not None:
        into[key] = round(seconds, 2)


def stage_main(stage: str, config_cls: type[C], run: Callable[..., dict[str, Any]], metrics_path: Path) -> None:
    """The `main()` of every stage: typed params in, one MLflow run, `metrics/<stage>.json` out.

    `run(cfg, root, log, tracker)` does the work and returns the metrics. Expected
    input errors (bad data, bad params) end with a one-line message and exit code 2.
    """
    from gr2model.data import DataError
    from tasks.tracking import stage_run

    log = setup_logging(stage)
    try:
        cfg = load_stage_config(stage, config_cls)
        root = Path.cwd()
        with stage_run(stage, cfg.model_dump()) as tracker:
            metrics = run(cfg, root, log, tracker)
            write_json_atomic(metrics, root / metrics_path)
            tracker.log_metrics(metrics)
    except (DataError, ParamsError) as exc:
        log.error("%s", exc)
        sys.exit(2)
