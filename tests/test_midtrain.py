"""Mid-training: no leakage of held-out items, texts the tokenizer knows, constrained beam search, the stage's build step."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
import pytest
import torch
from accelerate import Accelerator
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gr2model.models.ar_model import ARModelConfig, build_ar_model
from gr2model.data.dataset import leave_one_out
from gr2model.training.midtrain import (
    MIDTRAIN_WORDS,
    TASKS,
    MidtrainTasks,
    NextItemEvalConfig,
    build_examples,
    constrained_beam_search,
    encode_examples,
    next_item_eval,
    score_items_exact,
    sequence_prompt,
    sid_table,
)
from gr2model.task.rerank_format import ItemText
from gr2model.training.sft import IGNORE_INDEX, SFTConfig, sft_loss_sums, collate_right_padded, run_train_loop
from gr2model.teachers.teacher import TRACE_WORDS
from gr2model.task.tokenizer import build_tokenizer, special_ids

from tiny import TINY, TOY, randomize

_SID = re.compile(r"<a_\d+> <b_\d+> <c_\d+> <d_\d+>")


def _items(n: int) -> pl.DataFrame:
    """n items with distinct 4-code ids that share prefixes (a real trie) and 1-3 attributes."""
    ids = list(range(1, n + 1))
    return pl.DataFrame(
        {
            "item_id": ids,
            "sid": [[i % 3, (i // 3) % 2, i % 5, i] for i in ids],
            "attributes": [[1 + i % 4, 5 + i % 3][: 1 + i % 2] for i in ids],
        },
        schema={"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)},
    )


@pytest.fixture(scope="module")
def data() -> tuple[pl.DataFrame, pl.DataFrame]:
    """A small split where items 10, 19 and 20 occur only as validation/test targets."""
    seqs = [
        [1, 2, 3, 4, 19],
        [5, 6, 7, 8, 9, 10, 20],
        [2, 4, 6, 8, 19, 20],
        [11, 12, 13, 14, 15, 16, 17, 18, 1, 3, 5],  # long: windows with max_items=4
        [3, 9, 20, 19],
    ]
    sequences = pl.DataFrame({"user_id": list(range(1, len(seqs) + 1)), "items": seqs},
                             schema={"user_id": pl.Int64, "items": pl.List(pl.Int64)})  # fmt: skip
    return _items(20), leave_one_out(sequences)


def _explanations(items: ItemText) -> list[str]:
    return [
        f"the user last bought {' '.join(items.sid_tokens(2))} .",
        f"then {' '.join(items.sid_tokens(19))} .",  # cites a held-out-only item: dropped
    ]


def test_no_leakage_of_held_out_items(data) -> None:
    table, split = data
    items = ItemText(table)
    cfg = MidtrainTasks(max_items=4, persona_min_count=2)
    by_task = build_examples(split, table, cfg, _explanations(items))
    assert set(by_task) == set(TASKS)
    trains = {int(u): [int(i) for i in tr] for u, tr in zip(split["user_id"], split["train"].to_list())}
    train_items = {i for tr in trains.values() for i in tr}
    held_out = (set(split["valid"].to_list()) | set(split["test"].to_list())) - train_items
    assert held_out == {10, 19, 20}

    def items_in(text: str) -> list[int]:
        return [items.item_of_sid(m.group(0)) for m in _SID.finditer(text)]

    # Per user: the sequence examples are exactly the training part, in order, each target once.
    for user, train in trains.items():
        seq = [e for e in by_task["sequence"] if e.user_id == user]
        written = items_in(seq[0].prompt) + [i for e in seq for i in items_in(e.response)]
        assert written == train
        for e in by_task["persona"]:
            if e.user_id == user:
                assert set(items_in(e.prompt)) <= set(train)
    assert len([e for e in by_task["sequence"] if e.user_id == 4]) == 4  # 9 items: windows of 4 (2 of them context)
    # Items that occur only as held-out targets appear in no text at all.
    for examples in by_task.values():
        for e in examples:
            assert not set(items_in(e.prompt + " " + e.response)) & held_out, e
    assert len(by_task["trace"]) == 1
    assert {items_in(e.prompt)[0] for e in by_task["item_attributes"]} == train_items


def test_texts_tokenise_without_unk_and_sequence_end_is_not_trained(data) -> None:
    table, split = data
    items = ItemText(table)
    tok = build_tokenizer(table, [*TRACE_WORDS, *MIDTRAIN_WORDS], max_sid_code=20)
    by_task = build_examples(split, table, MidtrainTasks(max_items=4), _explanations(items))
    scfg = SFTConfig(max_length=64)
    for task, examples in by_task.items():
        assert examples, task
        for e in examples:
            ids = tok(f"{e.prompt} {e.response}", add_special_tokens=False)["input_ids"]
            assert tok.unk_token_id not in ids, (task, e)
        for enc, e in zip(encode_examples(tok, examples, scfg), examples):
            if task == "sequence":
                assert enc["labels"][-1] == IGNORE_INDEX and enc["weights"][-1] == 0.0  # the cut is not an end
                n_target = len(tok(e.response, add_special_tokens=False)["input_ids"])
                assert sum(enc["reasoning"]) == n_target == sum(1 for w in enc["weights"] if w > 0)
            else:
                assert enc["labels"][-1] == tok.eos_token_id and sum(enc["reasoning"]) == 0
    # Evaluation's next-item prompt reads like the training text: here the whole training part of user 1.
    [seq] = [e for e in by_task["sequence"] if e.user_id == 1]
    assert sequence_prompt(split["train"][0].to_list(), items, 4) == f"{seq.prompt} {seq.response}"


def test_beam_search_matches_exact_scoring_and_returns_only_items(data) -> None:
    table, _ = data
    tok = build_tokenizer(table, MIDTRAIN_WORDS, max_sid_code=20)
    model = randomize(build_ar_model(TINY, len(tok), **_ids(tok)), 0.3)
    item_ids, sids = sid_table(tok, table)
    items = ItemText(table)
    prompts = [tok(sequence_prompt(h, items, 10), add_special_tokens=False)["input_ids"] for h in ([1, 2], [5], [7, 8, 9, 3])]
    # Width = number of items: the search is exhaustive and must equal exact scoring.
    rows, scores = constrained_beam_search(model, prompts, sids, len(sids), tok.pad_token_id)
    for p, r, s in zip(prompts, rows, scores):
        exact = score_items_exact(model, p, sids)
        assert torch.equal(r, exact.argsort(descending=True))
        assert torch.allclose(s, exact.sort(descending=True).values, atol=1e-4)
    # A narrow beam returns distinct existing ids only (and the exact best one on a random model with no ties).
    rows, _ = constrained_beam_search(model, prompts, sids, 4, tok.pad_token_id)
    assert rows.shape == (3, 4) and (rows >= 0).all() and (rows < len(sids)).all()
    assert all(len(set(r.tolist())) == 4 for r in rows)
    # More beams than ids: the rest is -1.
    small = sids[:3]
    rows, scores = constrained_beam_search(model, prompts, small, 5, tok.pad_token_id)
    assert (rows[:, 3:] == -1).all() and torch.isinf(scores[:, 3:]).all() and set(rows[0, :3].tolist()) == {0, 1, 2}


def _ids(tok) -> dict[str, int]:
    sp = special_ids(tok)
    return {"pad_id": sp["pad"], "bos_id": sp["bos"], "eos_id": sp["eos"]}


def test_memorised_sequence_is_retrieved(data) -> None:
    """A tiny model trained on one sequence finds its next item with the beam search (and next_item_eval)."""
    table, _ = data
    tok = build_tokenizer(table, MIDTRAIN_WORDS, max_sid_code=20)
    model = build_ar_model(TOY, len(tok), **_ids(tok))
    sequences = pl.DataFrame({"user_id": [1], "items": [[4, 11, 7, 16, 2, 9]]}, schema={"user_id": pl.Int64, "items": pl.List(pl.Int64)})
    split = leave_one_out(sequences)  # train 4 11 7 16, valid 2, test 9
    full = pl.DataFrame({"user_id": [1], "train": [[4, 11, 7, 16, 2, 9]], "valid": [0], "test": [0]},
                        schema=split.schema)  # fmt: skip
    enc = encode_examples(tok, build_examples(full, table, MidtrainTasks(persona=False, item_attributes=False, attributes_item=False, trace=False)).get("sequence"), SFTConfig())
    cfg = SFTConfig(epochs=150, batch_size=1, lr=3e-3, warmup_steps=5)
    model, _, _ = run_train_loop(
        model, enc, lambda b: collate_right_padded(b, tok.pad_token_id), lambda m, b, e: sft_loss_sums(m, b), cfg,
        accelerator=Accelerator(cpu=True),
    )
    item_ids, sids = sid_table(tok, table)
    items = ItemText(table)
    prompt = tok(sequence_prompt([4, 11, 7, 16], items, 10), add_special_tokens=False)["input_ids"]
    rows, _ = constrained_beam_search(model, [prompt], sids, 5, tok.pad_token_id)
    assert int(item_ids[rows[0, 0]]) == 2
    ecfg = NextItemEvalConfig(eval_users=0, beam_width=10, batch_size=4)
    for which in ("valid", "test"):
        m = next_item_eval(model, tok, split, table, which, ecfg, max_items=10)
        assert m["recall@5"] == 1.0 and m["ndcg@10"] == 1.0 and m["n"] == 1


def test_pretrained_path_goes_through_the_build_step(data, tmp_path: Path) -> None:
    from tasks.midtrain import MidtrainConfig, build_model_and_tokenizer

    table, split = data
    # A tiny byte-level BPE (the Qwen kind) and a tiny Qwen3 saved with save_pretrained: no download.
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["the user likes a sequence of items", "history candidates ( ) : ,"], trainer)
    base_dir = tmp_path / "base"
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(base_dir)
    base_vocab = backend.get_vocab_size()
    build_ar_model(TINY, base_vocab, pad_id=0, bos_id=0, eos_id=0).save_pretrained(base_dir)

    cfg = MidtrainConfig(model=ARModelConfig(pretrained_path=str(base_dir)))
    model, tok = build_model_and_tokenizer(cfg, table)
    assert len(tok) > base_vocab and model.get_input_embeddings().weight.shape[0] == len(tok)
    assert model.config.hidden_size == TINY.hidden_size  # the pretrained model, not the from-scratch size
    items = ItemText(table)
    by_task = build_examples(split, table, MidtrainTasks(max_items=4), _explanations(items))
    for examples in by_task.values():
        enc = encode_examples(tok, examples, SFTConfig(max_length=128))
        assert len(enc) == len(examples)
    _, sids = sid_table(tok, table)  # every sid token is one token of the extended tokenizer
    prompt = tok(sequence_prompt([1, 2], items, 10), add_special_tokens=False)["input_ids"]
    rows, _ = constrained_beam_search(model, [prompt], sids, 10, tok.pad_token_id)
    assert (rows >= 0).all()


def test_length_grouped_batches_cover_every_example_once() -> None:
    from gr2model.training.sft import LengthGroupedBatches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 200, (1000,), generator=g).tolist()
    sampler = LengthGroupedBatches(lengths, batch_size=16, seed=0, group=8)
    first, second = list(sampler), list(sampler)
    assert len(first) == len(sampler) == 63
    for batches in (first, second):
        assert sorted(i for b in batches for i in b) == list(range(1000))
    assert first != second  # a new order each pass
    assert list(LengthGroupedBatches(lengths, 16, 0, 8)) == first  # a function of the seed
    padded = sum(max(lengths[i] for i in b) * len(b) for b in first)
    assert padded / sum(lengths) < 1.2
