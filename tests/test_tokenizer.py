"""The format's tokenizers: exact round trips, save/load, and a pretrained BPE extended with the format."""

from __future__ import annotations

import json
import random
from pathlib import Path

import polars as pl
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gr2model.task.rerank_format import (
    SPECIAL_TOKENS,
    FormatConfig,
    ItemText,
    build_full_text,
    build_prompt,
    build_response,
    parse_response,
)
from gr2model.task.tokenizer import build_tokenizer, extend_pretrained_tokenizer, format_tokens, special_ids

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "amazon-beauty"
SCHEMA = {"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)}
WORDS = ["the", "user", "likes", "lipstick", "so", "rank", "first", "because", "brand"]


def make_items() -> pl.DataFrame:
    """Items 1..12: sid [i, 10 + i, 20 + i, i % 3] (item 12's d code is 300), 4 attributes each."""
    ids = list(range(1, 13))
    sids = [[i, 10 + i, 20 + i, 300 if i == 12 else i % 3] for i in ids]
    attrs = [[i, i + 1, i + 2, i + 3] for i in ids]
    return pl.DataFrame({"item_id": ids, "sid": sids, "attributes": attrs}, schema=SCHEMA)


@pytest.fixture(scope="module")
def table() -> pl.DataFrame:
    return make_items()


@pytest.fixture(scope="module")
def tok(table: pl.DataFrame) -> PreTrainedTokenizerFast:
    return build_tokenizer(table, WORDS)


def texts(table: pl.DataFrame) -> list[str]:
    items = ItemText(table)
    cands = [3, 12, 7, 9, 1]
    prompt = build_prompt([2, 4, 6, 8, 10, 11], cands, items, FormatConfig())
    response = build_response(["the", "user", "likes", "<a_12>", "<b_22>", "<c_32>", "<d_300>", "<attr_9>", "so"],
                              [12, 3, 9, 1, 7], items)
    return [prompt, response, build_full_text(prompt, response)]


def test_vocabulary_layout(tok: PreTrainedTokenizerFast, table: pl.DataFrame) -> None:
    vocab = tok.get_vocab()
    assert [vocab[s] for s in SPECIAL_TOKENS] == list(range(7))
    assert special_ids(tok) == {"pad": 0, "bos": 2, "eos": 3, "user": 4, "assistant": 5, "mask": 6}
    assert (tok.pad_token_id, tok.eos_token_id, tok.mask_token_id, tok.unk_token_id) == (0, 3, 6, 1)
    # 9 JSON tokens + 4 prompt words + 3 x 256 codes + d codes 0..300 + attributes 1..15 + 50 positions + 9 words.
    assert len(tok) == 7 + 9 + 4 + 3 * 256 + 301 + 15 + 50 + len(WORDS)
    for t in ['"explanation"', '"recommendations"', '"', "<a_255>", "<d_300>", "<attr_15>", "history", "("]:
        assert t in vocab, t
    assert "<attr_16>" not in vocab and "<attr_0>" not in vocab


def test_words_order_does_not_matter_and_bad_words_are_refused(table: pl.DataFrame) -> None:
    a = build_tokenizer(table, WORDS + ["the", "history"])
    b = build_tokenizer(table, set(reversed(WORDS)))
    assert a.get_vocab() == b.get_vocab()
    for bad in ["", "two words", "tab\tword"]:
        with pytest.raises(ValueError, match="whitespace"):
            build_tokenizer(table, [bad])
    with pytest.raises(ValueError, match="max_sid_code"):
        build_tokenizer(table, [], max_sid_code=20)
    # Without items over the codebook size, d still gets the full codebook: a
    # subset of the items gives the same vocabulary.
    assert len(format_tokens(table.head(3))) == len(format_tokens(table)) - 45 - 9


def test_evidence_tokens_join_the_vocabulary_only_when_asked(table: pl.DataFrame) -> None:
    from gr2model.task.rerank_format import EVIDENCE_LEVELS

    with_ev = build_tokenizer(table, WORDS, max_evidence=3)
    plain = build_tokenizer(table, WORDS)
    assert len(with_ev) == len(plain) + 3 * EVIDENCE_LEVELS
    assert "<ev1_0>" not in plain.get_vocab()
    fmt = FormatConfig(answer="index", evidence=("a", "b", "c"), evidence_bins=((0.0,), (), (1.0, 2.0)))
    prompt = build_prompt([2, 4], [3, 12], ItemText(table), fmt, evidence=[[1, 0, 2], [0, 0, 7]])
    ids = with_ev(prompt).input_ids
    assert with_ev.unk_token_id not in ids and len(ids) == len(prompt.split(" "))
    assert with_ev.decode(ids, skip_special_tokens=False) == prompt
    with pytest.raises(ValueError, match="max_evidence"):
        build_tokenizer(table, WORDS, max_evidence=9)


def test_round_trip_text_ids_text(tok: PreTrainedTokenizerFast, table: pl.DataFrame) -> None:
    for text in texts(table):
        ids = tok(text).input_ids
        assert tok.unk_token_id not in ids
        assert len(ids) == len(text.split(" "))  # one id per token, nothing added
        assert tok.decode(ids, skip_special_tokens=False) == text
    full = texts(table)[2]
    ids = tok(full).input_ids
    assert ids[0] == special_ids(tok)["user"] and ids[-1] == tok.eos_token_id
    assert not tok.decode(ids, skip_special_tokens=True).startswith("<|user|>")


def test_unknown_word_is_unk(tok: PreTrainedTokenizerFast) -> None:
    assert tok("the zebra").input_ids == [tok.get_vocab()["the"], tok.unk_token_id]


def test_save_and_autotokenizer_load(tok: PreTrainedTokenizerFast, table: pl.DataFrame, tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert special_ids(loaded) == special_ids(tok)
    for text in texts(table):
        ids = tok(text).input_ids
        assert loaded(text).input_ids == ids
        assert loaded.decode(ids, skip_special_tokens=False) == text
    batch = loaded(texts(table)[:2], padding=True)
    assert batch.input_ids[1][-1] == loaded.pad_token_id


@pytest.mark.skipif(not (SHARED / "Beauty_item2sid_rqvae.json").exists(), reason="shared data set not found")
def test_real_beauty_items_round_trip() -> None:
    sids = json.loads((SHARED / "Beauty_item2sid_rqvae.json").read_text())
    attrs = json.loads((SHARED / "Beauty_item2attributes.json").read_text())
    ids = sorted(int(k) for k in sids)
    table = pl.DataFrame(
        {"item_id": ids, "sid": [sids[str(i)] for i in ids], "attributes": [attrs[str(i)] for i in ids]}, schema=SCHEMA
    )
    tok = build_tokenizer(table, WORDS)
    assert len(tok) == 7 + 9 + 4 + 4 * 256 + 637 + 50 + len(WORDS)
    items = ItemText(table)
    rng = random.Random(0)
    for _ in range(20):
        chosen = rng.sample(ids, 30)
        prompt = build_prompt(chosen[:20], chosen[20:], items, FormatConfig())
        response = build_response(["the", "user"], chosen[20:][::-1], items)
        text = build_full_text(prompt, response)
        ids_ = tok(text).input_ids
        assert tok.unk_token_id not in ids_ and tok.decode(ids_) == text
        decoded = tok.decode(tok(f"{response} <|eos|>").input_ids)
        assert parse_response(decoded, chosen[20:], items).ranking == chosen[20:][::-1]


# ------------------------------------------------------- a pretrained tokenizer


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE (the Qwen/GPT-2 kind), trained and saved here: no download."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(
        ["the user likes lipstick and shampoo", "a brand new face cream for dry skin",
         '{"explanation": "so", "recommendations": ["x", "y"]}', "history candidates ( ) : ,"],
        trainer,
    )
    path = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(path)
    return path


def test_extend_pretrained_tokenizer(bpe_dir: Path, table: pl.DataFrame, tmp_path: Path) -> None:
    base_size = len(AutoTokenizer.from_pretrained(bpe_dir))
    tok = extend_pretrained_tokenizer(bpe_dir, table)
    assert len(tok) == base_size + len(SPECIAL_TOKENS) + 2 + 3 * 256 + 301 + 15 + 50
    ids = special_ids(tok)
    assert tok.eos_token_id == ids["eos"] and tok.pad_token_id == ids["pad"] and tok.mask_token_id == ids["mask"]
    singles = ["<a_0>", "<a_255>", "<b_7>", "<c_200>", "<d_300>", "<attr_1>", "<attr_15>", '"explanation"']
    for t in [*singles, *SPECIAL_TOKENS]:
        assert len(tok(t).input_ids) == 1, t
        assert len(tok(f"x {t} y").input_ids) == len(tok("x y").input_ids) + 1, t  # its left space is absorbed

    items = ItemText(table)
    cands = [3, 12, 7, 9, 1]
    prompt, response, full = texts(table)
    for skip in (False, True):
        decoded = tok.decode(tok(response + " <|eos|>").input_ids, skip_special_tokens=skip)
        parsed = parse_response(decoded, cands, items)
        assert parsed.valid_permutation, decoded
        assert parsed.ranking == [12, 3, 9, 1, 7]
        # The explanation comes back in canonical spacing whatever the decode glued.
        assert parsed.explanation == "the user likes <a_12> <b_22> <c_32> <d_300> <attr_9> so"
    full_ids = tok(full).input_ids
    assert full_ids[0] == ids["user"] and full_ids[-1] == ids["eos"]
    # Only the spaces before the added tokens may go missing in decoding.
    assert "".join(tok.decode(full_ids).split()) == "".join(full.split())

    tok.save_pretrained(tmp_path / "ext")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "ext")
    assert loaded(full).input_ids == full_ids and special_ids(loaded) == ids


def test_extend_with_words_adds_whole_words(bpe_dir: Path, table: pl.DataFrame) -> None:
    tok = extend_pretrained_tokenizer(bpe_dir, table, ["moisturiser"])
    assert len(tok("moisturiser").input_ids) == 1
