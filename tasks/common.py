"""What every stage module shares: reading its params section, atomic writes, logging, timing.

A stage is `run(config, paths) -> metrics` plus a thin `main()` that reads its
section of `params.yaml`; DVC calls `python -m tasks.<stage>` and the Prefect flow
runs the same command through DVC, so there is one way to run a stage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError

from gr2model.bounds import FieldRangeError
from tasks.tracking import StageTracker, flatten

if TYPE_CHECKING:  # torch and accelerate load only in the training stages, not in the gr2 CLI
    from accelerate import PartialState

    from gr2model.training.resume import Checkpointer

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

# Ranges of the numeric params, carried in the schema. Floats refuse NaN
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
"""The reward of an invalid answer: a penalty, never a reward (gr2model.task.rewards.rerank_reward)."""
Fraction = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
"""A held-out share: 0 holds out nothing, 1 would leave nothing to train on."""


RESUME_SECTION = "resume"
"""The params.yaml section of the resumable-training knobs (not a stage: no DVC params dep,
since how often state is saved changes no output)."""
RESUME_DIR = Path(".gr2/resume")
"""Where training stages keep their saved states: `<workspace>/.gr2/resume/<stage>/<key>/`,
outside every DVC output (git ignores `.gr2/`)."""


class ParamsError(ValueError):
    """A params.yaml problem; the message names the file and the offending field."""


class StageConfig(BaseModel):
    """Base of every stage's typed config: unknown keys are errors, not silently ignored."""

    model_config = {"extra": "forbid", "frozen": True}


class ResumeConfig(StageConfig):
    """How often a training stage saves its full state (`gr2model.training.resume.Checkpointer`).

    A state is saved after every `every_steps` optimizer (or RL) steps and whenever
    `every_minutes` passed since the last save, and after the last step; both 0: no
    state at all (a killed stage starts over).
    """

    every_steps: Cap = 200  # 0: not by count
    every_minutes: NonNegative = 10.0  # 0: not by time


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


def load_resume_config(path: Path = Path(PARAMS_FILE)) -> ResumeConfig:
    """The `resume` section of params.yaml (defaults when the section is absent)."""
    if RESUME_SECTION not in read_params(path):
        return ResumeConfig()
    return load_stage_config(RESUME_SECTION, ResumeConfig, path)


def _md5_of(path: Path) -> str:
    """md5 of a file, or of a folder's files (relative names and contents, sorted); "missing" if absent."""
    digest = hashlib.md5()
    if path.is_file():
        files = [(path.name, path)]
    elif path.is_dir():
        files = sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*") if p.is_file())
    else:
        return "missing"
    for name, file in files:
        digest.update(name.encode() + b"\0")
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def stage_inputs(root: Path, stage: str) -> dict[str, str]:
    """md5 of each of `stage`'s DVC deps (dvc.yaml: data, checkpoints, code), by path.

    Hashed by content, not by time: DVC may check the same content out again.
    Empty without a dvc.yaml (a stage run outside a project).
    """
    dvc_file = root / "dvc.yaml"
    if not dvc_file.exists():
        return {}
    deps = (yaml.safe_load(dvc_file.read_text()).get("stages", {}).get(stage) or {}).get("deps", [])
    return {dep: _md5_of(root / dep) for dep in deps}


class StageResume:
    """Where a training stage keeps its resumable states, and whether they fit this run.

    The folder is `<root>/.gr2/resume/<stage>/<key>`, the key a hash of the stage's
    params and the md5 of its inputs (`stage_inputs`), with a `manifest.json` of both.
    Opening it removes the states of other keys, logging what differs (a rerun with
    other params or inputs starts fresh and says why). `checkpointer(name)` gives
    each training loop of the stage its own `gr2model.training.resume.Checkpointer`, which
    resumes from the newest state and logs it; `clear()` removes the stage's states
    once its outputs are written.
    """

    def __init__(
        self, root: Path, stage: str, params: dict[str, Any], cfg: ResumeConfig, log: logging.Logger, *, main: bool = True
    ) -> None:
        self.stage, self.cfg, self.log, self.main = stage, cfg, log, main
        self.manifest = {"params": params, "inputs": stage_inputs(root, stage)}
        self.key = hashlib.sha256(json.dumps(self.manifest, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.stage_dir = root / RESUME_DIR / stage
        self.folder = self.stage_dir / self.key
        self.checkpointers: dict[str, Checkpointer] = {}
        # Under several processes (main=False on the others) one process prunes and writes the
        # shared folder; the others only read their key's states, which the pruning keeps.
        if main:
            self._drop_other_keys()
            write_json_atomic(self.manifest, self.folder / "manifest.json")

    @property
    def enabled(self) -> bool:
        return self.cfg.every_steps > 0 or self.cfg.every_minutes > 0

    def _drop_other_keys(self) -> None:
        if not self.stage_dir.is_dir():
            return
        for other in sorted(p for p in self.stage_dir.iterdir() if p.is_dir() and p.name != self.key):
            if any(other.rglob("step-*")):
                self.log.warning("%s: saved training state in %s not used: %s; starting fresh", self.stage, other, self._why(other))
            shutil.rmtree(other, ignore_errors=True)

    def _why(self, other: Path) -> str:
        """What differs between another key's manifest and this run's."""
        try:
            theirs = json.loads((other / "manifest.json").read_text())
        except (OSError, ValueError):
            return "it has no readable manifest"
        reasons = []
        for part, what in (("params", "params changed"), ("inputs", "inputs changed")):
            mine, old = flatten(self.manifest[part]), flatten(theirs.get(part, {}))
            changed = sorted(k for k in mine.keys() | old.keys() if mine.get(k) != old.get(k))
            if changed:
                reasons.append(f"{what}: {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}")
        return "; ".join(reasons) or "its key differs"

    def checkpointer(self, name: str = "train") -> Checkpointer | None:
        """The Checkpointer of the stage's training loop `name` (None when resuming is off)."""
        from gr2model.training.resume import Checkpointer

        if not self.enabled:
            return None
        ckpt = Checkpointer(
            self.folder / name,
            every_steps=self.cfg.every_steps,
            every_seconds=self.cfg.every_minutes * 60.0,
            logger=self.log,
        )
        self.checkpointers[name] = ckpt
        return ckpt

    def resumed(self) -> dict[str, int]:
        """The loops that resumed, with the step each resumed from."""
        return {name: c.resumed_from for name, c in self.checkpointers.items() if c.resumed_from is not None}

    def clear(self) -> None:
        """Remove every saved state of the stage (its outputs are written); the main process's job."""
        if self.main:
            shutil.rmtree(self.stage_dir, ignore_errors=True)


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


LAUNCH_ENV = "GR2_LAUNCH"
"""The environment variable naming the launcher of the distributed stages, e.g.
`accelerate launch --config_file configs/accelerate/1node-8gpu.yaml` (unset or empty: plain `python`)."""
LAUNCHED_ENV = "GR2_LAUNCHED"
"""Set by a stage that re-executed itself under the launcher, so its processes run the stage
instead of launching again."""


def launcher() -> str:
    """The launcher command of `GR2_LAUNCH`, stripped ("" when unset: the stage runs in this process)."""
    return os.environ.get(LAUNCH_ENV, "").strip()


def launched() -> bool:
    """Whether this process is one of a launcher's (ours, or `accelerate launch`/`torchrun` run by hand)."""
    return bool(os.environ.get(LAUNCHED_ENV)) or "WORLD_SIZE" in os.environ


def launch_argv(stage: str, launch: str) -> list[str]:
    """The command that runs `python -m tasks.<stage>` under `launch`.

    `accelerate ...` and `torchrun ...` run as modules of this interpreter (the
    project's venv, whatever PATH says); any other launcher is run as written.
    Raises ParamsError when `launch` does not parse as a shell command.
    """
    try:
        words = shlex.split(launch)
    except ValueError as exc:
        raise ParamsError(f"{LAUNCH_ENV}={launch!r}: not a command line: {exc}") from exc
    modules = {"accelerate": "accelerate.commands.accelerate_cli", "torchrun": "torch.distributed.run"}
    if words and words[0] in modules:
        words = [sys.executable, "-m", modules[words[0]], *words[1:]]
    return [*words, "-m", f"tasks.{stage}"]


def process_state() -> PartialState:
    """accelerate's view of this process (index, count, device), starting the process group under a launcher.

    The same object the library's training loops get from `Accelerator()`, so the
    stage and its loops agree on who is the main process.
    """
    import torch
    from accelerate import PartialState

    # Without a GPU accelerate starts a process group (gloo) only when asked for CPU
    # processes; otherwise each process of a launcher would run alone as a world of one.
    return PartialState(cpu=not torch.cuda.is_available())


def requested_processes(launch: str) -> int | None:
    """The process count a launcher command line asks for (`--num_processes N`,
    `--nproc_per_node N`, ...), None when it does not say."""
    names = ("--num_processes", "--num-processes", "--nproc_per_node", "--nproc-per-node")
    words = shlex.split(launch) if launch else []
    # "--flag=N" as two words, like "--flag N"
    words = [part for word in words for part in (word.split("=", 1) if word.startswith(names) else [word])]
    for flag, value in zip(words, words[1:]):
        if flag in names and value.isdigit():
            return int(value)
    return None


def is_main_process() -> bool:
    """Whether this process writes the stage's outputs (always true without a launcher)."""
    return process_state().is_main_process


def full_state_dict(model: Any) -> dict[str, Any] | None:
    """The whole state dict of a trained model that FSDP shards between the processes (None
    when it is not sharded: one process or DDP, where `save_pretrained` reads the model).

    Every process must call it (the gather is a collective); the main process then
    writes it (`save_hf_checkpoint(state_dict=...)`).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    if process_state().distributed_type != DistributedType.FSDP:
        return None
    return Accelerator().get_state_dict(model)


def save_stage_checkpoint(path: Path, model: Any, tok: Any, stage_config: dict[str, Any]) -> None:
    """Write a trained model, its tokenizer and `stage_config` to the checkpoint folder `path`
    (atomically), from the main process only.

    Every process must call it: under FSDP the weights are first gathered from all of them
    (`full_state_dict`, a collective); under DDP every process holds the same weights and
    one writes them.
    """
    from gr2model.models.checkpoint import save_hf_checkpoint  # transformers: not at import (the gr2 CLI imports this module)

    weights = full_state_dict(model)
    if is_main_process():
        with atomic_dir(path) as out:
            save_hf_checkpoint(out, model, tok, stage_config, weights)


def accelerate_config(launch: str) -> tuple[str, str] | None:
    """(path, text) of the accelerate config file `launch` uses: its `--config_file`, else
    accelerate's default config file when the launcher is `accelerate launch`; None without one."""
    words = shlex.split(launch) if launch else []
    path: str | None = None
    for i, word in enumerate(words):
        if word in ("--config_file", "--config-file") and i + 1 < len(words):
            path = words[i + 1]
        elif word.startswith(("--config_file=", "--config-file=")):
            path = word.split("=", 1)[1]
    if path is None and words[:1] == ["accelerate"]:
        from accelerate.commands.config.config_args import default_config_file

        path = default_config_file
    if path is None or not Path(path).is_file():
        return None
    return path, Path(path).read_text()


def runtime_launch_tags(state: PartialState) -> dict[str, str]:
    """The MLflow tags of how the stage was launched: `runtime.launch` (GR2_LAUNCH, "python"
    without one, "external" when run under a launcher by hand), `runtime.num_processes`,
    `runtime.distributed_type`, `runtime.mixed_precision`, and the accelerate config file's
    path and text (`runtime.accelerate_config_file`, `runtime.accelerate_config`) when there is one.
    `gr2 reproduce` reruns with the recorded launcher (flows/reproduce.py)."""
    launch = launcher()
    tags = {
        "runtime.launch": launch or ("external" if launched() else "python"),
        "runtime.num_processes": str(state.num_processes),
        "runtime.distributed_type": str(state.distributed_type.value),
        "runtime.mixed_precision": os.environ.get("ACCELERATE_MIXED_PRECISION", "no"),
    }
    config = accelerate_config(launch)
    if config is not None:
        tags["runtime.accelerate_config_file"], tags["runtime.accelerate_config"] = config[0], config[1][:5000]
    return tags


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


def stage_main(
    stage: str,
    config_cls: type[C],
    run: Callable[..., dict[str, Any]],
    metrics_path: Path,
    *,
    resumable: bool = False,
    distributed: bool = False,
) -> None:
    """The `main()` of every stage: typed params in, one MLflow run, `metrics/<stage>.json` out.

    `run(cfg, root, log, tracker)` does the work and returns the metrics. Expected
    input errors (bad data, bad params) end with a one-line message and exit code 2.
    A `resumable` (training) stage is also given `resume=StageResume(...)`: its loops
    save their state as params.yaml `resume:` says and a rerun with the same params and
    inputs continues from the newest one; the states are removed once the metrics
    are written.

    A `distributed` stage runs on every process of a launcher: with `GR2_LAUNCH` set
    (and not already launched) this process replaces itself with
    `$GR2_LAUNCH -m tasks.<stage>`, so `python -m tasks.<stage>`, the command in
    dvc.yaml, stays the same whatever the launcher (dvc.lock does not change). Every
    process runs `run` (the training loops and decoders share the work through
    accelerate); only the main process opens the MLflow run, writes the metrics and
    the outputs (`run` checks `is_main_process()` around its writes), and removes
    the saved states. A stage that is not `distributed` ignores `GR2_LAUNCH` and
    refuses to run on several processes.
    """
    from gr2model.data.dataset import DataError
    from tasks.tracking import stage_run

    log = setup_logging(stage)
    try:
        cfg = load_stage_config(stage, config_cls)
        if not launched() and launcher():
            if distributed:
                argv = launch_argv(stage, launcher())
                log.info("launching %s: %s", stage, shlex.join(argv))
                sys.stdout.flush()
                sys.stderr.flush()
                os.execvpe(argv[0], argv, {**os.environ, LAUNCHED_ENV: "1"})
            log.info("%s runs in one process: %s=%r does not apply to it", stage, LAUNCH_ENV, launcher())
        if not distributed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ParamsError(
                f"stage {stage} runs in one process, not under a launcher of {os.environ['WORLD_SIZE']} "
                f"processes: run it with `python -m tasks.{stage}`"
            )
        state = process_state() if distributed else None
        asked = requested_processes(launcher()) if state is not None else None
        if state is not None and asked and asked > 1 and state.num_processes == 1:
            # `accelerate launch --num_processes 2` alone runs one process (its simple launcher).
            raise ParamsError(
                f"{LAUNCH_ENV}={launcher()!r} asks for {asked} processes but {stage} runs in one: accelerate "
                "starts several only with --multi_gpu (torchrun, also on CPUs) or a config file that says so"
            )
        main = state is None or state.is_main_process
        if not main:  # the main process says it once
            logging.getLogger().setLevel(logging.WARNING)
        root = Path.cwd()
        extra: dict[str, Any] = {}
        if resumable:
            # Read (and checked) before any work, like the stage's own params.
            rcfg = load_resume_config()
            extra["resume"] = StageResume(root, stage, cfg.model_dump(mode="json"), rcfg, log, main=main)
        with stage_run(stage, cfg.model_dump()) if main else nullcontext(StageTracker(None)) as tracker:
            if state is not None:
                tracker.set_tags(runtime_launch_tags(state))
                if state.num_processes > 1:
                    log.info("%s on %d processes (%s)", stage, state.num_processes, state.distributed_type.value)
            metrics = run(cfg, root, log, tracker, **extra)
            if state is not None:
                state.wait_for_everyone()  # every process is done with the saved states and the outputs
            if main:
                write_json_atomic(metrics, root / metrics_path)
                tracker.log_metrics(metrics)
            if resumable:
                resumed = extra["resume"].resumed()
                if resumed and main:
                    tracker.set_tags({f"gr2.resumed_from_step.{name}": step for name, step in resumed.items()})
                    log.warning("%s finished after resuming (%s)", stage, ", ".join(f"{n} from step {s}" for n, s in resumed.items()))
                extra["resume"].clear()
    except (DataError, ParamsError) as exc:
        log.error("%s", exc)
        sys.exit(2)
