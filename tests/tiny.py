"""Tiny models, tokenizers, prompts and two-process plumbing shared by the model tests.

Imported as `tiny` (pytest puts tests/ on sys.path: the test files are not in a package).

Three setups:
- raw ids (the decoders' tests): a model over VOCAB ids with PAD, BOS, EOS = 0, 1, 2 and no
  tokenizer (`random_model`, `random_ids`; as module fixtures `model` and `prompts` in
  conftest.py);
- the format's tokenizer over one item (the RL and distillation tests): `one_item_tokenizer`,
  `tiny_model`, `random_prompts`;
- the toy re-ranking task over 4 items (the SFT and CFT tests): `toy_tokenizer`, `toy_items`,
  `toy_model`, `toy_examples`.
"""

from __future__ import annotations

import faulthandler
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from gr2model.models.ar_model import ARModelConfig, build_ar_model
from gr2model.models.checkpoint import save_hf_checkpoint
from gr2model.task.rerank_format import FormatConfig, ItemText, build_prompt, build_response
from gr2model.task.tokenizer import build_tokenizer, special_ids

# ------------------------------------------------------------------ models

TINY = ARModelConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_position_embeddings=64
)
DECODER = replace(TINY, max_position_embeddings=128)  # the raw-id model of the decoders' tests
TOY = ARModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=128
)


def randomize(model: torch.nn.Module, scale: float, seed: int = 0) -> torch.nn.Module:
    """Redraw every matrix of `model` from N(0, scale^2), in place. The default init
    (std 0.02) gives near-uniform logits and a model that repeats one token; larger
    weights make confident, varied outputs, so equal outputs mean something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, scale, generator=g)
    return model


def tiny_model(tok, seed: int = 0, scale: float | None = None, config: ARModelConfig = TINY):
    """An AR model for `tok` (`config`, TINY by default), randomized with `scale` when given."""
    sp = special_ids(tok)
    model = build_ar_model(config, len(tok), pad_id=sp["pad"], bos_id=sp["bos"], eos_id=sp["eos"], seed=seed)
    return model if scale is None else randomize(model, scale, seed)


# ------------------------------------------------------------------ raw ids

VOCAB = 40
PAD, BOS, EOS = 0, 1, 2
NO_EOS = -1  # an id no token has: rows run to max_new_tokens
LENGTHS = [3, 11, 1, 7, 16]


def random_model() -> torch.nn.Module:
    """DECODER over VOCAB raw ids (seed 0), randomized with scale 0.3."""
    return randomize(build_ar_model(DECODER, VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, seed=0), 0.3, seed=0)


def random_ids(lengths: Sequence[int] = LENGTHS, seed: int = 1) -> list[list[int]]:
    """Prompts of the given lengths over the non-special ids 3..VOCAB-1."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


# -------------------------------------------------------- one-item tokenizer


def one_item_tokenizer():
    """The format's tokenizer over one item with codes 0: a 24-token vocabulary, mask token included."""
    items = pl.DataFrame(
        {"item_id": [1], "sid": [[0, 0, 0, 0]], "attributes": [[]]},
        schema={"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)},
    )
    return build_tokenizer(items, [], max_sid_code=0, max_positions=0)


def random_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """n prompts of 2 to 6 tokens over ids 7.. of `one_item_tokenizer` (no specials)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 7, (n,), generator=g).tolist()
    return [torch.randint(7, len(tok), (k,), generator=g).tolist() for k in lengths]


# ------------------------------------------------------------------ toy task

WORDS = ["because", "first", "likes"]
TOY_CANDIDATES = list(itertools.permutations([1, 2, 3, 4], 3))


def items_table() -> pl.DataFrame:
    ids = [1, 2, 3, 4]
    return pl.DataFrame(
        {"item_id": ids, "sid": [[i % 2, i // 2, i, 0] for i in ids], "attributes": [[i] for i in ids]},
        schema={"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)},
    )


def toy_items() -> ItemText:
    return ItemText(items_table())


def toy_tokenizer():
    return build_tokenizer(items_table(), WORDS, max_sid_code=4)


def toy_model(tok, seed: int = 0):
    return tiny_model(tok, seed, config=TOY)


def toy_examples(items: ItemText) -> list[tuple[str, str]]:
    """Every ordered choice of 3 of the 4 items as candidates (TOY_CANDIDATES); the
    answer is their reverse order after a fixed explanation: a deterministic function."""
    fc = FormatConfig(history_len=0, with_attributes=False)
    return [
        (build_prompt([], c, items, fc), build_response(["because", "first"], list(reversed(c)), items))
        for c in TOY_CANDIDATES
    ]



def write_toy_stage_inputs(root: Path, table: str, flag: str, checkpoint: str, made_by: str) -> None:
    """What a stage that reads (prompt, response) pairs and a checkpoint needs, from the toy task:
    its 24 pairs as `root/table` (parquet) with a True `flag` column ("kept" for traces,
    "valid_permutation" for trajectories), and a toy model saved as `root/checkpoint`
    whose stage_config says `made_by`."""
    tok, items = toy_tokenizer(), toy_items()
    examples = toy_examples(items)
    (root / table).parent.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(
        {"prompt": [p for p, _ in examples], "response": [r for _, r in examples], flag: [True] * len(examples)}
    ).write_parquet(root / table)
    save_hf_checkpoint(root / checkpoint, toy_model(tok), tok, {"stage": made_by})


# ----------------------------------------------------------- two processes


def two_process_worker(out: Path, train: Callable[[Accelerator], Any]) -> None:
    """The body of one of two processes forked by `accelerate.debug_launcher`: run
    `train(accelerator)` and save the result's weights and history under `out`
    (rank{i}.pt, history{i}.pt; read them back with `agreeing_ranks`)."""
    faulthandler.dump_traceback_later(60, exit=True)  # a deadlock fails the test instead of hanging it
    AcceleratorState._reset_state(True)  # the parent's single-process state came along with the fork
    acc = Accelerator(cpu=True)
    torch.set_num_threads(1)  # accelerate just set 2 threads per process
    assert acc.num_processes == 2
    result = train(acc)
    torch.save([p.detach() for p in result.model.parameters()], out / f"rank{acc.process_index}.pt")
    torch.save(result.history, out / f"history{acc.process_index}.pt")
    faulthandler.cancel_dump_traceback_later()


def equals_one_process(out: Path, one: Any, atol: float = 1e-5) -> list[dict[str, float]]:
    """Check that a two-process run (saved by `two_process_worker` under `out`) equals the
    one-process result `one` (`.model`, `.history`): weights to `atol` (the processes sum
    gradients and pad rows in another order) and every non-timing metric of every step
    to 1e-5 relative. Returns the history."""
    weights, history = agreeing_ranks(out)
    ones = [p.detach() for p in one.model.parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(weights, ones)) <= atol
    assert len(history) == len(one.history)
    for mine, theirs in zip(history, one.history):
        kept = {k: v for k, v in theirs.items() if not k.endswith("_s")}
        assert {k: mine[k] for k in kept} == {k: pytest.approx(v, rel=1e-5, abs=1e-7) for k, v in kept.items()}
    return history


def agreeing_ranks(out: Path) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
    """(weights, history) of rank 0 after checking that both ranks hold the same
    weights and that only the main process logged."""
    rank0, rank1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1))
    assert torch.load(out / "history1.pt") == []  # only the main process logs
    return rank0, torch.load(out / "history0.pt")
