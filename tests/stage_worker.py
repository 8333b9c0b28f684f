"""A stage process for the resume tests: runs the real stage and SIGKILLs itself right
after a given saved state (no cleanup, no flush: what `kill -9` does).

    python tests/stage_worker.py STAGE KILL_AFTER_SAVES [LOOP]      (the cwd is the stage's workspace)

Apart from tests/resume_worker.py, whose tiny training setups import most of the
library: a stage process then starts in the time of the stage's own imports.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path

from gr2model.training.resume import Checkpointer


def stage(module: str, kill_after_saves: int, loop: str | None = None) -> None:
    """Run the real stage `python -m tasks.<module>` in this process (the cwd is its
    workspace), SIGKILLed right after a loop's `kill_after_saves`-th state is on disk
    (0: never); with `loop`, only that training loop's saves count (a stage with
    several loops, e.g. retrieve's `sasrec`, `fold0`, `fold1`)."""
    real_save = Checkpointer.save

    def save_then_maybe_die(self: Checkpointer, step: int) -> Path:
        folder = real_save(self, step)
        if kill_after_saves and self.saves == kill_after_saves and loop in (None, self.directory.name):
            os.kill(os.getpid(), signal.SIGKILL)
        return folder

    Checkpointer.save = save_then_maybe_die  # type: ignore[method-assign]
    importlib.import_module(f"tasks.{module}").main()  # what `python -m tasks.<module>` runs


if __name__ == "__main__":
    stage(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
