"""A training process for the resume tests: trains a tiny model with a Checkpointer and
can SIGKILL itself after a given step (no cleanup, no flush: what `kill -9` does).

    python tests/resume_worker.py KIND STATE_DIR OUT KILL_AFTER EVERY_STEPS

KIND: sft, cft, dapo or rl (the library loops `train_sft`, `train_cft`, `train_dapo`,
`train_diffusion_rl` on the tiny setups of tests/tiny.py), or sasrec (`train_sasrec`
with early stopping on the tiny data of tests/test_sasrec.py). KILL_AFTER: the step
after whose metrics (sasrec: after whose optimizer step) the process kills itself
(0: never). On success, OUT/result.pt holds {"weights": state_dict, "history": [...],
"resumed_from": step or None, "saves": n, "best_epoch": e, "best_valid": {...}}
(the last two: sasrec's early stopping, None for the others).
`build` is also called in the test process for the run that is never stopped.
Whole stages are killed by tests/stage_worker.py.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gr2model.models.block_diffusion import convert_to_block_diffusion
from gr2model.training.cft import CFTConfig, train_cft
from gr2model.training.dapo import DAPOConfig, train_dapo
from gr2model.training.diffusion_rl import DiffusionRLConfig, train_diffusion_rl
from gr2model.training.resume import Checkpointer
from gr2model.retrieval.sasrec import SASRecTrainConfig, train_sasrec
from gr2model.training.sft import SFTConfig, train_sft

from test_sasrec import random_sequences, split_last, successor_sequences, tiny_cfg
from tiny import one_item_tokenizer, random_prompts, tiny_model, toy_examples, toy_items, toy_model, toy_tokenizer

# Small but not trivial: several epochs (sft, cft: 3 batches each) or steps with
# resampling and two inner epochs (dapo, rl), so a resume lands mid-epoch and
# mid-stream, with generators that have been drawn from.
SFT = SFTConfig(epochs=3, batch_size=4, lr=2e-3, warmup_steps=2, seed=3)
CFT = CFTConfig(epochs=3, batch_size=4, lr=2e-3, warmup_steps=2, seed=3, block_size=2, valid_every=4)
DAPO = DAPOConfig(group_size=4, prompts_per_step=2, steps=6, minibatch_size=4, inner_epochs=2, lr=1e-2,
                  max_new_tokens=4, seed=7)
RL = DiffusionRLConfig(group_size=4, prompts_per_step=2, steps=5, minibatch_size=4, inner_epochs=2, lr=1e-2,
                       max_new_tokens=6, threshold=0.2, seed=7)
# Validation targets are random, so validation NDCG peaks early: the best epoch comes
# well before the stop (patience 3), and the weights returned are not the last ones.
SASREC = SASRecTrainConfig(epochs=60, batch_size=16, lr=1e-2, patience=3, seed=0)
SASREC_BATCHES = 7
"""Optimizer steps per sasrec epoch (ceil(100 users / 16))."""
STEPS = {"sft": 9, "cft": 9, "dapo": DAPO.steps, "rl": RL.steps}
"""Optimizer steps (sft, cft: 3 epochs of ceil(10 / 4) batches) or RL steps of each kind."""


def _graded_reward(i: int, c: list[int]) -> tuple[float, dict[str, float]]:
    # Varies within a group, so dynamic sampling keeps groups and updates happen.
    return float(len(c)) + 0.1 * c[0], {"first": float(c[0])}


def build(kind: str) -> Callable[..., Any]:
    """(on_step, checkpointer) -> the result of one tiny training run of `kind`."""
    if kind in ("sft", "cft"):
        tok, items = toy_tokenizer(), toy_items()
        examples = toy_examples(items)
        train, valid = examples[:10], examples[10:13]
        if kind == "sft":
            return lambda **kw: train_sft(toy_model(tok), tok, train, SFT, valid=valid, **kw)
        return lambda **kw: train_cft(toy_model(tok), tok, train, CFT, valid=valid, **kw)
    if kind == "sasrec":
        train, valid = successor_sequences(100, seed=5), split_last(random_sequences(60, seed=6))
        return lambda checkpointer=None, on_step=None: train_sasrec(
            train, tiny_cfg(), SASREC, valid=valid, checkpointer=checkpointer, on_epoch=on_step
        )
    tok = one_item_tokenizer()
    prompts = random_prompts(tok, 6, seed=7)
    if kind == "dapo":
        return lambda **kw: train_dapo(tiny_model(tok), tok, prompts, _graded_reward, DAPO, **kw)
    if kind == "rl":
        def rl(**kw: Any) -> Any:
            policy = convert_to_block_diffusion(tiny_model(tok), tok, 4)
            return train_diffusion_rl(policy, tok, prompts, _graded_reward, RL, **kw)

        return rl
    raise ValueError(f"unknown kind {kind!r}")


class _DieAfterStep(Checkpointer):
    """A Checkpointer whose process SIGKILLs itself right after optimizer step `kill_after`
    (and its save, when one was due): for sasrec, whose rows are per epoch, not per step."""

    def __init__(self, directory: str, kill_after: int, **kw: Any) -> None:
        super().__init__(directory, **kw)
        self.kill_after = kill_after

    def step_done(self, step: int, *, final: bool = False) -> bool:
        saved = super().step_done(step, final=final)
        if self.kill_after and step == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return saved


def main(kind: str, state_dir: str, out: str, kill_after: int, every_steps: int) -> None:
    torch.set_num_threads(1)

    def on_step(metrics: dict[str, float]) -> None:
        # Only training steps count (sft and cft also emit validation rows).
        if kill_after and metrics["step"] == kill_after and "valid_loss" not in metrics:
            os.kill(os.getpid(), signal.SIGKILL)

    if kind == "sasrec":
        ckpt: Checkpointer = _DieAfterStep(state_dir, kill_after, every_steps=every_steps)
        result = build(kind)(checkpointer=ckpt)
    else:
        ckpt = Checkpointer(state_dir, every_steps=every_steps)
        result = build(kind)(on_step=on_step, checkpointer=ckpt)
    torch.save(
        {"weights": result.model.state_dict(), "history": result.history, "resumed_from": ckpt.resumed_from,
         "saves": ckpt.saves, "best_epoch": getattr(result, "best_epoch", None),
         "best_valid": getattr(result, "best_valid", None)},
        Path(out) / "result.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
