"""Resumable training: a loop's full state saved every N steps or M seconds, restored on restart.

A `Checkpointer` owns one folder. Every save writes a complete state into a
temporary sibling (`.tmp-step-<n>`) and renames it to `step-<n>` in one
`rename`, then removes the older states: a kill at any moment leaves either the
previous complete state or the new one, never half of one (the folder name is
the marker). On start, `restore` loads the newest `step-<n>` and returns n.

What a state holds:
- through `accelerate.Accelerator.save_state`: the prepared model(s) and
  optimizer(s), objects registered with `register_for_checkpointing` (the lr
  scheduler of `gr2model.training.sft.run_train_loop`), and the global RNG states
  (python, numpy, torch, the device's) of each process;
- `loop_state_<rank>.pt`, one per process: the loop's own state (`Stateful`):
  data position, history of emitted metrics, its torch.Generator objects (and
  whatever else the loop carries between steps: `gr2model.retrieval.sasrec.train_sasrec`
  adds its sampler's numpy generator and its early-stopping state). It is
  written per process, not through `register_for_checkpointing`, because
  accelerate writes custom objects from the main process only, and the loops'
  sampling generators differ between processes.

Bit-identity on a CPU: a loop restores its position and generators so that
the resumed run draws the same batches and the same noise as a run that was
never stopped (`skip_batches` replays an interrupted epoch); `tests/test_resume.py` kills training processes with SIGKILL and
compares the weights with `torch.equal`.

The folder's identity (which params and inputs it belongs to) is the caller's
business: the stages key it by a hash of their params and input files
(`tasks.common.StageResume`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from gr2model.bounds import check

__all__ = ["Checkpointer", "Stateful", "latest_state", "generator_state", "set_generator_state", "skip_batches"]

log = logging.getLogger(__name__)

_STATE = re.compile(r"^step-(\d+)$")


class Stateful(Protocol):
    """What a loop hands to `Checkpointer`: its own state as a picklable dict, and back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def latest_state(directory: Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest complete state in `directory`, or None.

    Only `step-<n>` folders count: a `.tmp-*` folder is a save that was cut short.
    """
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _STATE.match(p.name))]
    return max(found) if found else None


class Checkpointer:
    """Decides when a training loop saves its state, saves it atomically, and restores the newest one.

    Usage inside a loop (every process of a distributed run makes the same calls):

        ckpt.attach(accelerator, loop_state, scheduler)   # after accelerator.prepare
        start = ckpt.restore()                             # 0 on a fresh start
        for step in range(start, total):
            ...one optimizer step...
            ckpt.step_done(step + 1, final=step + 1 == total)

    Args:
        directory: the folder that holds this loop's states (created on the first save).
        every_steps: save after every this many steps (0: not by count).
        every_seconds: save when this many seconds passed since the last save or the
            start (0: not by time). Both 0: only the final state is saved (`final=True`).
        clock: seconds, monotonic (a test passes a fake one).
        logger: where "resuming from step n" is reported (at WARNING: a resumed stage
            must say so on the quiet console).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_steps: int = 0,
        every_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        check(self, "every_steps", ge=0)
        check(self, "every_seconds", ge=0)
        self._clock = clock
        self._last_save = clock()
        self._log = logger or log
        self._accelerator: Accelerator | None = None
        self._state: Stateful | None = None
        self.resumed_from: int | None = None
        """The step `restore` resumed from (None: a fresh start)."""
        self.saves = 0
        """States written by this process's run (for tests and logs)."""

    # ------------------------------------------------------------------ setup

    def attach(self, accelerator: Accelerator, state: Stateful, *registered: Any) -> None:
        """Tie the checkpointer to a loop: its accelerator (after `prepare`), its own
        state, and objects with state_dict/load_state_dict that accelerate should save
        besides the prepared ones (e.g. an lr scheduler that was not prepared)."""
        self._accelerator = accelerator
        self._state = state
        if registered:
            accelerator.register_for_checkpointing(*registered)

    def _attached(self) -> tuple[Accelerator, Stateful]:
        if self._accelerator is None or self._state is None:
            raise RuntimeError("Checkpointer.attach must be called before restore or save")
        return self._accelerator, self._state

    # ---------------------------------------------------------------- restore

    def restore(self) -> int:
        """Load the newest complete state, if any, and return its step (0: none, a fresh start).

        Loads the prepared models and optimizers, the registered objects and every RNG
        state (accelerate), then the loop's own state of this process.
        """
        accelerator, state = self._attached()
        found = latest_state(self.directory)
        if found is None:
            return 0
        step, folder = found
        accelerator.load_state(str(folder))
        rank_file = folder / f"loop_state_{accelerator.process_index}.pt"
        if not rank_file.exists():
            raise RuntimeError(f"{folder}: no {rank_file.name}: saved by a run with another number of processes")
        # weights_only=False: the loop state holds plain python lists and dicts next to
        # tensors; the file is our own, written by `save` a moment before the kill.
        state.load_state_dict(torch.load(rank_file, map_location="cpu", weights_only=False))
        self.resumed_from = step
        self._last_save = self._clock()
        self._log.warning("resuming from the state saved after step %d (%s)", step, folder)
        return step

    def replay(self, history: Sequence[dict[str, float]], callback: Callable[[dict[str, float]], None] | None) -> None:
        """Pass each restored history entry to `callback` on the main process (nothing
        on a fresh start, whose history is empty): a tracker that starts with this
        process then records the whole curve."""
        accelerator, _ = self._attached()
        if callback is not None and accelerator.is_main_process:
            for metrics in history:
                callback(metrics)

    # ------------------------------------------------------------------- save

    def step_done(self, step: int, *, final: bool = False) -> bool:
        """Call after step `step` (1-based count of steps done); saves when it is due.

        Due: `final` (the loop's last step, so a stage killed after training but before
        writing its outputs skips the training on rerun), every `every_steps` steps, or
        `every_seconds` after the last save. Returns whether it saved.
        """
        accelerator, _ = self._attached()
        due = final or (self.every_steps > 0 and step % self.every_steps == 0)
        if not due and self.every_seconds > 0:
            due = self._clock() - self._last_save >= self.every_seconds
            if accelerator.num_processes > 1:
                # Clocks differ between processes; the save is collective, so rank 0 decides.
                due = bool(broadcast_object_list([due])[0])
        if due:
            self.save(step)
        return due

    def save(self, step: int) -> Path:
        """Write the state after `step` to `step-<step>` atomically; remove older states.

        Collective: every process calls it (each writes its own RNG and loop state).
        """
        accelerator, state = self._attached()
        main = accelerator.is_main_process
        final = self.directory / f"step-{step:09d}"
        tmp = self.directory / f".tmp-step-{step:09d}"
        if main:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save of the same step cut short earlier
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        torch.save(state.state_dict(), tmp / f"loop_state_{accelerator.process_index}.pt")
        accelerator.wait_for_everyone()
        if main:
            _fsync_tree(tmp)
            if final.exists():  # the same step saved before a kill, then replayed: replace it
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(self.directory)
            for old in self.directory.iterdir():
                if old != final and old.is_dir() and (_STATE.match(old.name) or old.name.startswith(".tmp-step-")):
                    shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        self._last_save = self._clock()
        self.saves += 1
        log.info("saved the training state after step %d to %s", step, final)
        return final

    def clear(self) -> None:
        """Remove every state of this folder (the work it protected is done)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    """Flush the files of a state before the rename publishes it: after a power cut a
    renamed folder must not hold empty files (a kill alone never loses written data)."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def generator_state(gen: torch.Generator) -> torch.Tensor:
    """A generator's state as a CPU byte tensor (CUDA generators included)."""
    return gen.get_state().cpu()


def set_generator_state(gen: torch.Generator, state: torch.Tensor) -> None:
    """Restore what `generator_state` returned (on the generator's own device)."""
    gen.set_state(state.cpu())


def skip_batches(loader: Iterable[Any], n: int) -> Iterator[Any]:
    """An iterator over `loader` past its first `n` batches, with the global RNG as if
    none had been drawn (how a loop resumes in the middle of an epoch).

    The restored global RNG state is the one after the last finished step, which
    already includes what making this epoch's iterator drew (a DataLoader without
    its own generator seeds its workers from the global RNG); skipping re-makes the
    iterator, so the draws it makes are undone. The skipped batches are collated
    and dropped: cheap next to a forward, and it keeps the sampler's draws exact.
    The caller first rewinds the sampler's own shuffle state to the epoch's start.
    """
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    it = iter(loader)
    for _ in range(n):
        next(it)
    torch.set_rng_state(cpu_state)
    if cuda_states is not None:
        torch.cuda.set_rng_state_all(cuda_states)
    return it
