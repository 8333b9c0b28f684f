"""Block-causal masks (element by element), AR -> block-diffusion conversion, B = 1 equals AR."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from gr2model.decoding.ar_decode import left_pad
from gr2model.models.block_diffusion import (
    block_causal_mask,
    block_diffusion_mask,
    block_diffusion_settings,
    block_ids,
    convert_to_block_diffusion,
)

from tiny import PAD, VOCAB, random_model


def tiny_tokenizer(with_mask: bool) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of VOCAB tokens: the specials, then words w3, w4, ...;
    with_mask makes token 6 the mask token (as in our format's tokenizer)."""
    names = ["<|pad|>", "<|bos|>", "<|eos|>"] + [f"w{i}" for i in range(3, VOCAB)]
    if with_mask:
        names[6] = "<|mask|>"
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(names)}, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    roles = {"pad_token": "<|pad|>", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    if with_mask:
        roles["mask_token"] = "<|mask|>"
    return PreTrainedTokenizerFast(tokenizer_object=backend, **roles)


@pytest.fixture(scope="module")
def ar_model() -> torch.nn.Module:
    return random_model()


def as_bool(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# ---------------------------------------------------------------- masks


def test_block_ids() -> None:
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]])
    got = block_ids(pos, torch.tensor([2, 1]), block_size=2)
    assert got.tolist() == [[-1, -1, 0, 0, 1, 1, 2], [-1, -1, -1, 0, 0, 1, 1]]
    with pytest.raises(ValueError):
        block_ids(pos, torch.tensor([2, 1]), block_size=0)


def test_mask_one_row_two_blocks() -> None:
    # prompt 2 tokens, response 4 tokens in blocks of 2.
    mask = block_causal_mask(torch.ones(1, 6), prompt_len=2, block_size=2)
    expected = as_bool([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1],
    ])
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], expected)


def test_mask_left_padding_and_query_offset() -> None:
    # Row 0: prompt of 3; row 1: prompt of 1 left-padded by 2. One block of 2.
    attn = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    mask = block_causal_mask(attn, prompt_len=3, block_size=2)
    row0 = as_bool([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
    ])
    row1 = as_bool([
        [1, 0, 0, 0, 0],  # a pad query sees only itself (no empty softmax row)
        [0, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],  # no real query ever sees a pad
        [0, 0, 1, 1, 1],
        [0, 0, 1, 1, 1],
    ])
    assert torch.equal(mask[0, 0], row0) and torch.equal(mask[1, 0], row1)
    # Queries = the last two columns (a forward after a 3-token cache).
    tail = block_causal_mask(attn, prompt_len=3, block_size=2, q_offset=3)
    assert tail.shape == (2, 1, 2, 5)
    assert torch.equal(tail[0, 0], row0[3:]) and torch.equal(tail[1, 0], row1[3:])


def test_mask_partial_block_and_right_pad() -> None:
    # Prompt 1, response of 4 in blocks of 3 (the second block has 1 token), one pad after.
    mask = block_causal_mask(torch.tensor([[1, 1, 1, 1, 1, 0]]), prompt_len=1, block_size=3)
    expected = as_bool([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ])
    assert torch.equal(mask[0, 0], expected)


def test_block_size_one_is_causal_with_padding() -> None:
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0]])
    mask = block_causal_mask(attn, prompt_len=4, block_size=1)[:, 0]
    valid = attn.bool()
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    expected = causal & valid[:, None, :] & valid[:, :, None]
    expected |= torch.eye(7, dtype=torch.bool) & ~valid[:, :, None]
    assert torch.equal(mask, expected)


def test_mask_from_positions_with_a_gap_column() -> None:
    # A cache whose column 3 is an unused slot between block 0 and block 1
    # (what a ragged cache holds): prompt 1, B = 2.
    pos = torch.tensor([[0, 1, 2, 0, 3, 4]])
    valid = torch.tensor([[1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    cols = torch.arange(6)[None]
    mask = block_diffusion_mask(pos, valid, cols, pos, valid, torch.tensor([1]), block_size=2)
    expected = as_bool([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 1, 1],
        [1, 1, 1, 0, 1, 1],
    ])
    assert torch.equal(mask[0, 0], expected)


# ---------------------------------------------------------------- conversion


def test_convert_copies_weights_and_sets_config(ar_model) -> None:
    tok = tiny_tokenizer(with_mask=True)
    bd = convert_to_block_diffusion(ar_model, tok, block_size=4)
    assert bd is not ar_model and type(bd) is type(ar_model)
    assert block_diffusion_settings(bd) == (4, 6)
    a, b = ar_model.state_dict(), bd.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A copy, not shared storage: training the converted model leaves the AR one alone.
    assert bd.lm_head.weight.data_ptr() != ar_model.lm_head.weight.data_ptr()
    assert not hasattr(ar_model.config, "block_size")
    with pytest.raises(ValueError):
        block_diffusion_settings(ar_model)


def test_convert_adds_mask_token_when_missing(ar_model) -> None:
    tok = tiny_tokenizer(with_mask=False)
    assert tok.mask_token_id is None
    bd = convert_to_block_diffusion(ar_model, tok, block_size=2)
    assert tok.mask_token_id == VOCAB and tok.convert_ids_to_tokens(VOCAB) == "<|mask|>"
    assert bd.get_input_embeddings().weight.shape[0] == VOCAB + 1
    assert bd.config.mask_token_id == VOCAB and bd.config.vocab_size == VOCAB + 1
    assert torch.equal(bd.get_input_embeddings().weight[:VOCAB], ar_model.get_input_embeddings().weight)


def test_save_and_load_keeps_settings(ar_model, tmp_path: Path) -> None:
    bd = convert_to_block_diffusion(ar_model, tiny_tokenizer(with_mask=True), block_size=3)
    bd.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32)
    assert type(back) is type(bd)
    assert block_diffusion_settings(back) == (3, 6)
    a, b = bd.state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_block_size_one_reproduces_ar_logits(ar_model) -> None:
    bd = convert_to_block_diffusion(ar_model, tiny_tokenizer(with_mask=True), block_size=1).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 2, 8)]
    ids, attn = left_pad(prompts, PAD)
    prompt_len = ids.shape[1]
    response = torch.randint(3, VOCAB, (3, 6), generator=g)
    ids = torch.cat([ids, response], dim=1)
    attn = torch.cat([attn, torch.ones_like(response)], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ar = ar_model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        mask = block_causal_mask(attn, prompt_len, block_size=1)
        out = bd(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        # B = 4 changes the response logits but not the prompt's (prompt stays causal).
        mask4 = block_causal_mask(attn, prompt_len, block_size=4)
        out4 = bd(input_ids=ids, attention_mask=mask4, position_ids=pos).logits
    real = attn.bool()
    assert torch.allclose(out[real], ar[real], atol=1e-6, rtol=0)
    in_prompt = real.clone()
    in_prompt[:, prompt_len:] = False
    assert torch.allclose(out4[in_prompt], ar[in_prompt], atol=1e-6, rtol=0)
    assert not torch.allclose(out4[:, prompt_len:], ar[:, prompt_len:], atol=1e-3)
