"""SASRec pre-ranker: masking, causality, training behaviour, persistence, multi-process.

Everything runs on tiny synthetic data on a CPU in a few seconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gr2model.retrieval.sasrec import (
    SASRec,
    SASRecConfig,
    SASRecScorer,
    SASRecTrainConfig,
    load_sasrec,
    next_item_loss,
    save_sasrec,
    softmax_cross_entropy,
    train_sasrec,
    training_windows,
)
from gr2model.retrieval.scoring import evaluate_full_ranking

N_ITEMS = 40


def tiny_cfg(**kw) -> SASRecConfig:
    base = {"num_items": N_ITEMS, "max_len": 8, "hidden": 16, "heads": 2, "layers": 2, "dropout": 0.1}
    base.update(kw)
    return SASRecConfig(**base)


def successor_sequences(n: int, seed: int, min_len: int = 4, max_len: int = 9) -> list[list[int]]:
    """Planted pattern: item i is always followed by item i + 1 (wrapping N_ITEMS -> 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = int(rng.integers(1, N_ITEMS + 1))
        length = int(rng.integers(min_len, max_len + 1))
        out.append([(start - 1 + j) % N_ITEMS + 1 for j in range(length)])
    return out


def random_sequences(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, N_ITEMS + 1, size=int(rng.integers(3, 10))).tolist() for _ in range(n)]


def split_last(seqs: list[list[int]]) -> tuple[list[list[int]], np.ndarray]:
    return [s[:-1] for s in seqs], np.array([s[-1] for s in seqs])


# --------------------------------------------------------------------------- model


def test_shapes_and_no_nan_with_padding():
    torch.manual_seed(0)
    model = SASRec(tiny_cfg()).train()
    ids = torch.tensor([[0, 0, 0, 3, 4, 5], [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0]])
    hidden = model(ids)
    assert hidden.shape == (3, 6, 16)
    assert model.item_logits(hidden).shape == (3, 6, N_ITEMS + 1)
    assert torch.isfinite(hidden).all()  # fully padded rows included
    targets = torch.tensor([[0, 0, 0, 4, 5, 6], [2, 3, 4, 5, 6, 7], [0] * 6])
    loss, count = next_item_loss(model, ids, targets)
    loss.backward()
    assert int(count) == 9
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_output_is_tied_to_item_embedding():
    model = SASRec(tiny_cfg())
    h = torch.randn(5, 16)
    torch.testing.assert_close(model.item_logits(h), h @ model.item_emb.weight.T)


def test_left_padding_does_not_change_last_position():
    torch.manual_seed(0)
    model = SASRec(tiny_cfg()).eval()
    seq = [7, 3, 9, 12]
    with torch.no_grad():
        outs = [model.item_logits(model(torch.tensor([[0] * pad + seq]))[0, -1]) for pad in (0, 1, 4)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


def test_causal_later_items_do_not_change_earlier_positions():
    torch.manual_seed(0)
    model = SASRec(tiny_cfg()).eval()
    a = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10]])
    b = a.clone()
    b[0, 5:] = torch.tensor([30, 31, 32])
    with torch.no_grad():
        ha, hb = model(a), model(b)
    torch.testing.assert_close(ha[:, :5], hb[:, :5], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(ha[:, 5], hb[:, 5])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_chunked_cross_entropy_matches_reference(dtype, tol):
    torch.manual_seed(0)
    h = torch.randn(70, 16, requires_grad=True)
    w = torch.randn(N_ITEMS + 1, 16, requires_grad=True)
    y = torch.randint(1, N_ITEMS + 1, (70,))
    loss = softmax_cross_entropy(h, w, y, chunk=16, dtype=dtype)
    (3 * loss).backward()
    got = (loss.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    logits = h @ w.T
    logits[:, 0] = float("-inf")
    ref = torch.nn.functional.cross_entropy(logits, y)
    (3 * ref).backward()
    for a, b in zip(got, (ref.detach(), h.grad, w.grad)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert torch.isfinite(got[2]).all() and got[2][0].abs().max() == 0  # padding row gets no gradient


def test_training_windows_keep_last_items():
    inputs, targets = training_windows([[1, 2, 3], [4], list(range(1, 13))], max_len=4)
    assert inputs.shape == targets.shape == (2, 4)  # the length-1 sequence has no target
    assert inputs[0].tolist() == [0, 0, 1, 2] and targets[0].tolist() == [0, 0, 2, 3]
    assert inputs[1].tolist() == [8, 9, 10, 11] and targets[1].tolist() == [9, 10, 11, 12]


# --------------------------------------------------------------------------- scoring


def test_scorer_returns_log_probabilities():
    torch.manual_seed(0)
    scorer = SASRecScorer(SASRec(tiny_cfg()), batch_size=2)
    hist = [[1, 2, 3], list(range(1, 20)), [5], []]
    s = scorer.score(hist)
    assert s.shape == (4, N_ITEMS + 1) and s.dtype == np.float32
    assert np.all(np.isneginf(s[:, 0]))
    np.testing.assert_allclose(np.exp(s[:, 1:]).sum(axis=1), 1.0, atol=1e-4)
    # Only the last max_len items count.
    np.testing.assert_array_equal(scorer.score([list(range(1, 20))]), scorer.score([list(range(12, 20))]))


# --------------------------------------------------------------------------- training


def test_loss_falls_full_and_sampled_softmax():
    seqs = random_sequences(60, seed=1)
    for negatives in (0, 8):
        res = train_sasrec(seqs, tiny_cfg(), SASRecTrainConfig(epochs=6, batch_size=16, lr=5e-3, num_negatives=negatives))
        losses = [h["loss"] for h in res.history]
        assert len(losses) == 6 and res.best_epoch == 6 and res.best_valid == {}
        assert losses[-1] < losses[0] - 0.1, losses
        assert {"epoch", "loss", "seconds"} <= set(res.history[0])


def test_planted_successor_pattern_is_learned():
    train = successor_sequences(400, seed=0)
    valid_h, valid_t = split_last(successor_sequences(100, seed=1))
    test_h, test_t = split_last(successor_sequences(200, seed=2))
    cfg = tiny_cfg(hidden=32, dropout=0.0)
    res = train_sasrec(
        train, cfg, SASRecTrainConfig(epochs=15, batch_size=32, lr=1e-2, patience=3), valid=(valid_h, valid_t)
    )
    got = evaluate_full_ranking(SASRecScorer(res.model), test_h, test_t, ks=(1,))

    class Popularity:
        num_items = N_ITEMS

        def __init__(self, seqs):
            self.counts = np.bincount(np.concatenate(seqs), minlength=N_ITEMS + 1).astype(np.float32)

        def score(self, histories):
            return np.tile(self.counts, (len(histories), 1))

    pop = evaluate_full_ranking(Popularity(train), test_h, test_t, ks=(1,))
    assert got["recall@1"] > 0.9, got
    assert pop["recall@1"] < 0.2, pop


def test_same_seed_same_model_other_seed_differs():
    seqs = random_sequences(50, seed=3)
    valid = split_last(random_sequences(20, seed=4))
    runs = [
        train_sasrec(seqs, tiny_cfg(), SASRecTrainConfig(epochs=3, batch_size=8, seed=s), valid=valid)
        for s in (7, 7, 8)
    ]
    a, b, c = (r.model.state_dict() for r in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in runs[0].history] == [h["loss"] for h in runs[1].history]
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_early_stopping_returns_best_epoch_weights():
    # Validation targets are random, so validation NDCG stops improving quickly.
    seqs = successor_sequences(100, seed=5)
    valid_h, valid_t = split_last(random_sequences(60, seed=6))
    seen = []
    res = train_sasrec(
        seqs,
        tiny_cfg(),
        SASRecTrainConfig(epochs=60, batch_size=16, lr=1e-2, patience=2),
        valid=(valid_h, valid_t),
        on_epoch=seen.append,
    )
    assert len(res.history) < 60
    assert len(res.history) == res.best_epoch + 2  # stopped after `patience` epochs without improvement
    assert seen == res.history
    best_row = res.history[res.best_epoch - 1]
    assert best_row["valid_ndcg@10"] == max(h["valid_ndcg@10"] for h in res.history)
    # The returned weights are the best epoch's, not the last epoch's.
    again = evaluate_full_ranking(SASRecScorer(res.model), valid_h, valid_t, ks=(5, 10))
    assert again["ndcg@10"] == pytest.approx(res.best_valid["ndcg@10"], abs=1e-9)
    assert again["ndcg@10"] == pytest.approx(best_row["valid_ndcg@10"], abs=1e-9)


def test_max_valid_users_uses_a_fixed_subset():
    seqs = random_sequences(40, seed=9)
    valid = split_last(random_sequences(50, seed=10))
    res = train_sasrec(
        seqs, tiny_cfg(), SASRecTrainConfig(epochs=2, batch_size=16, max_valid_users=10), valid=valid
    )
    assert res.best_valid["n"] == 10


def test_save_load_round_trip(tmp_path: Path):
    torch.manual_seed(0)
    model = SASRec(tiny_cfg(hidden=8, heads=1, layers=1)).eval()
    save_sasrec(model, tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["hidden"] == 8
    loaded = load_sasrec(tmp_path / "ckpt")
    assert loaded.cfg == model.cfg
    hist = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [40]]
    np.testing.assert_array_equal(SASRecScorer(model).score(hist), SASRecScorer(loaded).score(hist))


# --------------------------------------------------------------------------- multi-process


def _two_process_worker(out_dir: str) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # The forked child inherits the parent's single-process accelerate state
    # (earlier tests created an Accelerator); drop it so this one joins the group.
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    assert acc.num_processes == 2
    res = train_sasrec(
        successor_sequences(64, seed=0),
        tiny_cfg(),
        SASRecTrainConfig(epochs=3, batch_size=8, patience=5),
        valid=split_last(successor_sequences(21, seed=1)),  # odd: shards of unequal size
        accelerator=acc,
    )
    checksum = float(sum(p.double().sum() for p in res.model.state_dict().values()))
    Path(out_dir, f"rank{acc.process_index}.json").write_text(
        json.dumps({"best_epoch": res.best_epoch, "valid_n": res.best_valid["n"], "checksum": checksum,
                    "losses": [h["loss"] for h in res.history]})
    )


def test_two_processes_train_in_sync(tmp_path: Path):
    from accelerate import debug_launcher

    debug_launcher(_two_process_worker, args=(str(tmp_path),), num_processes=2)
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0 == r1  # same weights, same gathered metrics, same early-stopping decision
    assert r0["valid_n"] == 21  # every validation user was scored exactly once
    assert os.environ.get("ACCELERATE_USE_CPU") is None  # the launcher restored the environment
