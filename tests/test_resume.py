"""Resumable training (a long run survives being killed): a training process killed with SIGKILL and started again
resumes from its last saved state and ends with the weights and metrics of a run that was
never stopped, bit for bit on a CPU; the Checkpointer saves when due, atomically, and keeps
only the newest state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

import resume_worker
from gr2model.training.resume import Checkpointer, latest_state
from gr2model.training.sft import SFTConfig, sft_loss_sums, collate_right_padded, encode_example, run_train_loop

from tiny import toy_examples, toy_items, toy_model, toy_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("tokens_per_s", "rollout_s", "update_s", "teacher_s", "seconds")  # seconds: sasrec's epoch time


def comparable(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """The history without wall-clock timings (which differ between any two runs)."""
    return [{k: v for k, v in h.items() if k not in TIMING} for h in history]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:5]}"


def run_worker(kind: str, state: Path, out: Path, kill_after: int, every_steps: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "resume_worker.py"), kind, str(state), str(out), str(kill_after),
         str(every_steps)],
        env=env, capture_output=True, text=True, timeout=300,
    )


# ------------------------------------------------------------------ SIGKILL, then resume


@pytest.mark.integration  # starts a training process and SIGKILLs it
@pytest.mark.parametrize(
    ("kind", "kill_after", "every_steps", "resumed_from"),
    [
        ("sft", 5, 2, 4),    # epoch 2 of 3, one batch of it done: the order is replayed mid-epoch
        # dapo and rl (~15 s each) are `slow`: sft and cft keep the same resume machinery in the default suite
        pytest.param("dapo", 4, 3, 3, marks=pytest.mark.slow),  # the prompt stream and both generators carried over
        ("cft", 7, 3, 6),    # per-example noise, a step validation (valid_every=4) before the kill
        pytest.param("rl", 3, 2, 2, marks=pytest.mark.slow),  # diffusion RL: decode noise and replayed trajectories
    ],
)
def test_sigkill_then_rerun_equals_an_uninterrupted_run(
    kind: str, kill_after: int, every_steps: int, resumed_from: int, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    killed = run_worker(kind, state, tmp_path, kill_after, every_steps)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "result.pt").exists()
    assert latest_state(state) == (resumed_from, state / f"step-{resumed_from:09d}")

    resumed = run_worker(kind, state, tmp_path, 0, every_steps)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from the state saved after step {resumed_from}" in resumed.stderr
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    assert got["resumed_from"] == resumed_from

    torch.set_num_threads(1)  # as in the workers: float sums depend on the thread count
    reference = resume_worker.build(kind)()
    assert_same_weights(got["weights"], reference.model.state_dict())
    assert comparable(got["history"]) == comparable(reference.history)
    assert len(reference.history) >= resume_worker.STEPS[kind]
    # The state after the last step stays until the stage that owns it clears it.
    assert latest_state(state)[0] == resume_worker.STEPS[kind]


# ------------------------------------------------------------------ SASRec (the retrieve stage)


def _saved_loop_state(state: Path) -> tuple[int, dict[str, Any]]:
    """(step, the loop's own state) of the newest state in `state` (one process)."""
    step, folder = latest_state(state)
    return step, torch.load(folder / "loop_state_0.pt", weights_only=False)


@pytest.mark.integration  # starts a training process and SIGKILLs it
@pytest.mark.parametrize("case", ["mid_epoch", pytest.param("between_best_and_stop", marks=pytest.mark.slow)])  # ~20 s each
def test_sasrec_sigkill_then_rerun_equals_an_uninterrupted_run(case: str, tmp_path: Path) -> None:
    """`train_sasrec` with early stopping, SIGKILLed mid-epoch (epoch 2: the sampler's
    generator has drawn an order before), or after its best epoch and before early
    stopping ends it: the rerun stops at the same epoch with the same (best) weights,
    history and validation metrics."""
    torch.set_num_threads(1)  # as in the workers: float sums depend on the thread count
    reference = resume_worker.build("sasrec")()
    best, epochs, per_epoch = reference.best_epoch, len(reference.history), resume_worker.SASREC_BATCHES
    # The premise: training ended by early stopping, `patience` epochs after the best one.
    assert epochs == best + resume_worker.SASREC.patience < resume_worker.SASREC.epochs

    if case == "mid_epoch":
        kill_after, every_steps = per_epoch + 3, 3
    else:  # killed in the 2nd epoch after the best one, its state saved inside that epoch
        kill_after, every_steps = per_epoch * (best + 1) + 4, 4
    resumed_from = kill_after // every_steps * every_steps
    state = tmp_path / "state"
    killed = run_worker("sasrec", state, tmp_path, kill_after, every_steps)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "result.pt").exists()
    step, saved = _saved_loop_state(state)
    assert step == resumed_from and saved["step"] == resumed_from and not saved["finished"]
    assert saved["epoch"] == (resumed_from - 1) // per_epoch + 1
    assert saved["batch"] == resumed_from - (saved["epoch"] - 1) * per_epoch
    assert comparable(saved["history"]) == comparable(reference.history[: saved["epoch"] - 1])
    if case == "between_best_and_stop":
        # The early-stopping state survives: the best epoch, its metrics and its weights
        # (those the uninterrupted run returns), with epochs without improvement already counted.
        assert saved["best_epoch"] == best < saved["epoch"] - 1
        assert saved["best_valid"] == reference.best_valid
        assert_same_weights(saved["best_state"], reference.model.state_dict())

    resumed = run_worker("sasrec", state, tmp_path, 0, every_steps)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from the state saved after step {resumed_from}" in resumed.stderr
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    assert got["resumed_from"] == resumed_from
    assert_same_weights(got["weights"], reference.model.state_dict())
    assert comparable(got["history"]) == comparable(reference.history)
    assert (got["best_epoch"], got["best_valid"]) == (best, reference.best_valid)
    step, final = _saved_loop_state(state)  # kept until the stage that owns it clears it
    assert step == epochs * per_epoch and final["finished"]


def test_sasrec_finished_state_trains_nothing(tmp_path: Path) -> None:
    """retrieve killed after a SASRec run finished (e.g. during a later cross-fit fold):
    the rerun of that run restores the final state, trains and saves nothing, replays its
    history to on_epoch and returns the same best weights and metrics."""
    first_ckpt = Checkpointer(tmp_path)  # neither by count nor by time: only the final state
    first = resume_worker.build("sasrec")(checkpointer=first_ckpt)
    assert first_ckpt.saves == 1
    seen: list[dict[str, float]] = []
    again = Checkpointer(tmp_path)
    second = resume_worker.build("sasrec")(checkpointer=again, on_step=seen.append)
    assert again.resumed_from == len(first.history) * resume_worker.SASREC_BATCHES and again.saves == 0
    assert seen == first.history == second.history
    assert (second.best_epoch, second.best_valid) == (first.best_epoch, first.best_valid)
    assert_same_weights(first.model.state_dict(), second.model.state_dict())


# ------------------------------------------------------------------ in process


def test_length_grouped_batches_resume_mid_epoch(tmp_path: Path) -> None:
    """midtrain's path: `run_train_loop` with `lengths` (LengthGroupedBatches), stopped by an
    exception after step 5 of 9, resumed from step 4 (epoch 2 of 3, one of its 3 batches
    done): same weights and history."""
    tok, items = toy_tokenizer(), toy_items()
    cfg = SFTConfig(epochs=3, batch_size=4, lr=2e-3, warmup_steps=2, seed=5)
    encoded = [encode_example(tok, p, r, cfg) for p, r in toy_examples(items)[:10]]
    lengths = [len(e["input_ids"]) for e in encoded]

    def train(on_step: Any = None, checkpointer: Checkpointer | None = None) -> tuple[torch.nn.Module, list]:
        model, history, _ = run_train_loop(
            toy_model(tok), encoded, lambda b: collate_right_padded(b, tok.pad_token_id),
            lambda m, batch, epoch: sft_loss_sums(m, batch), cfg, accelerator=Accelerator(cpu=True),
            on_step=on_step, lengths=lengths, checkpointer=checkpointer,
        )
        return model, history

    class Crash(Exception):
        pass

    def crash_after_5(metrics: dict[str, float]) -> None:
        if metrics["step"] == 5:
            raise Crash

    with pytest.raises(Crash):
        train(crash_after_5, Checkpointer(tmp_path, every_steps=2))
    resumed = Checkpointer(tmp_path, every_steps=2)
    model, history = train(None, resumed)
    assert resumed.resumed_from == 4
    ref_model, ref_history = train()
    assert_same_weights(model.state_dict(), ref_model.state_dict())
    assert comparable(history) == comparable(ref_history)


def test_a_finished_state_skips_training(tmp_path: Path) -> None:
    """Killed after training but before the stage wrote its outputs: the rerun trains nothing."""
    ckpt = Checkpointer(tmp_path)  # neither by count nor by time: only the final state
    first = resume_worker.build("dapo")(checkpointer=ckpt)
    assert ckpt.saves == 1 and latest_state(tmp_path)[0] == resume_worker.DAPO.steps
    seen: list[dict[str, float]] = []
    again = Checkpointer(tmp_path)
    second = resume_worker.build("dapo")(checkpointer=again, on_step=seen.append)
    # Nothing trained, nothing saved; on_step got the restored history (a new tracker run's curve).
    assert again.resumed_from == resume_worker.DAPO.steps and seen == first.history and again.saves == 0
    assert_same_weights(first.model.state_dict(), second.model.state_dict())
    assert second.history == first.history


# ------------------------------------------------------------------ the Checkpointer


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def _attached(path: Path, **kw: Any) -> tuple[Checkpointer, _Counter, torch.nn.Module]:
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))
    counter = _Counter()
    ckpt = Checkpointer(path, **kw)
    ckpt.attach(acc, counter)
    return ckpt, counter, model


def test_saves_when_due_by_steps_by_time_and_at_the_end(tmp_path: Path) -> None:
    now = [0.0]
    ckpt, _, _ = _attached(tmp_path / "a", every_steps=3, every_seconds=60, clock=lambda: now[0])
    due = []
    for step in range(1, 9):
        now[0] += 25.0  # 25 s per step: the clock fires after 3 steps without a save (75 s)
        due.append(ckpt.step_done(step, final=step == 8))
    # step 3 (count), 6 (count), 8 (final); the time rule never fires: a count save came first.
    assert due == [False, False, True, False, False, True, False, True]
    now[0] = 0.0
    ckpt, _, _ = _attached(tmp_path / "b", every_seconds=60, clock=lambda: now[0])
    due = []
    for step in range(1, 7):
        now[0] += 25.0
        due.append(ckpt.step_done(step))
    assert due == [False, False, True, False, False, True]  # at 75 s, then 75 s after that save
    with pytest.raises(ValueError, match="every_steps"):
        Checkpointer(tmp_path, every_steps=-1)


def test_keeps_only_the_newest_state_and_ignores_a_cut_save(tmp_path: Path) -> None:
    ckpt, counter, model = _attached(tmp_path)
    assert ckpt.restore() == 0 and ckpt.resumed_from is None
    counter.n = 7
    ckpt.save(2)
    with torch.no_grad():
        model.weight.add_(1.0)
    saved_weight = model.weight.detach().clone()
    counter.n = 11
    ckpt.save(5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000005"]
    # A save cut short by a kill: a temporary folder, never taken for a state.
    (tmp_path / ".tmp-step-000000009").mkdir()
    (tmp_path / ".tmp-step-000000009" / "model.safetensors").write_bytes(b"half")

    again, counter2, model2 = _attached(tmp_path)
    assert again.restore() == 5 and counter2.n == 11
    assert torch.equal(model2.weight, saved_weight)
    again.save(6)  # the next save removes the cut one and the older state
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000006"]
    again.clear()
    assert not tmp_path.exists()


def test_restore_before_attach_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="attach"):
        Checkpointer(tmp_path).restore()
