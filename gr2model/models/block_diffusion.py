"""The block-diffusion model: the AR re-ranker's weights under a block-causal attention mask.

A block-diffusion decoder writes the response a block of `block_size` tokens at
a time. Inside the block being written every position starts as the mask token
and several positions may be committed per model forward; finished blocks are
fixed context, like an AR prefix. The architecture and the weights are the AR
model's, unchanged: only the attention mask differs, so conversion is a copy.

Conventions (shared with the CFT trainer, `gr2model.training.cft`):
- a row is its prompt (p tokens) then its response; response position r is in
  block r // block_size;
- query q may attend key k iff k is at or before q (causal), or both are
  response positions of the same block (bidirectional inside a block); prompt
  tokens are causal among themselves, so an AR prefill is reused as is; pads
  are never attended by a real token;
- the token shift of the AR model is kept: the logits at a position predict the
  token at the next position. Response position kB+i (i >= 1) is predicted from
  position kB+i-1 of the same block; kB (i = 0) from the last token of the
  finished block k-1 (the last prompt token for k = 0);
- with block_size 1 the mask is exactly causal, so the converted model gives
  the AR model's logits.

The masks are built from each slot's position id and a validity flag, not from
its column, so a KV cache may hold the rows' blocks at different columns (the
decoder in `gr2model.decoding.diffusion_decode` lets each row advance at its own pace).
A pad query (or any invalid slot) attends only to its own column: SDPA's output
for a row of the mask that is all False is NaN on some kernels, and a NaN value
would poison the real queries' attention through 0 * NaN.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gr2model.task.rerank_format import MASK

__all__ = [
    "block_ids",
    "block_diffusion_mask",
    "block_causal_mask",
    "convert_to_block_diffusion",
    "block_diffusion_settings",
]


def block_ids(positions: torch.Tensor, prompt_lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block of every slot: response position r is in block r // block_size, prompt slots in -1.

    Args:
        positions: (N, T) long position ids, 0 on each row's first prompt token.
        prompt_lengths: (N,) long, each row's prompt length p (its response
            starts at position p).
        block_size: B >= 1.
    Returns:
        (N, T) long block index; -1 on prompt positions (and on pads, whose
        position ids are below p).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    rel = positions - prompt_lengths[:, None]
    return torch.where(rel >= 0, torch.div(rel, block_size, rounding_mode="floor"), -1)


def block_diffusion_mask(
    query_positions: torch.Tensor,
    query_valid: torch.Tensor,
    query_columns: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    prompt_lengths: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """The block-causal attention mask of arbitrary slots, from position ids and validity.

    A valid query attends a valid key iff key position <= query position, or
    both are response positions of the same block. An invalid query (a pad, an
    unused slot) attends only to its own column, so no row of the mask is empty.

    Args:
        query_positions: (N, Q) long position ids of the queries.
        query_valid: (N, Q) bool, False on pads and unused slots.
        query_columns: (N, Q) long, the key column each query occupies (where
            its own key/value is written).
        key_positions: (N, K) long position ids of the keys.
        key_valid: (N, K) bool, False on pads and unused slots.
        prompt_lengths: (N,) long prompt length of each row.
        block_size: B >= 1.
    Returns:
        (N, 1, Q, K) bool, True where the query may attend the key: the 4D
        `attention_mask` that HF models with SDPA use as is.
    """
    causal = key_positions[:, None, :] <= query_positions[:, :, None]
    if block_size != 1:  # (a block of one position adds nothing to the causal test; block_ids checks B)
        q_blk = block_ids(query_positions, prompt_lengths, block_size)[:, :, None]
        k_blk = block_ids(key_positions, prompt_lengths, block_size)[:, None, :]
        causal = causal | ((q_blk == k_blk) & (q_blk >= 0))
    allowed = causal & key_valid[:, None, :] & query_valid[:, :, None]
    cols = torch.arange(key_positions.shape[1], device=key_positions.device)
    own = (cols[None, None, :] == query_columns[:, :, None]) & ~query_valid[:, :, None]
    return (allowed | own)[:, None]


def block_causal_mask(
    attention_mask: torch.Tensor, prompt_len: int, block_size: int, q_offset: int = 0
) -> torch.Tensor:
    """The block-causal mask of a contiguous batch: left-padded prompts, then the responses.

    Column c >= prompt_len holds response position c - prompt_len of every row
    (left padding aligns the responses); pads (0 in `attention_mask`, on the
    left of a prompt or after a response) are never attended.

    Args:
        attention_mask: (N, T) 0/1 or bool key-padding mask over all T columns
            (prompt and response), 1 on real tokens.
        prompt_len: the padded prompt width: the response starts at this column.
        block_size: B >= 1.
        q_offset: the queries are the columns [q_offset, T), as in a forward
            over the last T - q_offset tokens with the first q_offset in a KV
            cache; 0 gives the full square mask.
    Returns:
        (N, 1, T - q_offset, T) bool, True where the query may attend the key.
    """
    valid = attention_mask.bool()
    # Positions restart at 0 on each row's first real token, as in the AR decoder.
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    prompt_lengths = valid[:, :prompt_len].sum(-1)
    width = valid.shape[1]
    cols = torch.arange(q_offset, width, device=valid.device).expand(valid.shape[0], -1)
    return block_diffusion_mask(
        positions[:, q_offset:], valid[:, q_offset:], cols, positions, valid, prompt_lengths, block_size
    )


def block_diffusion_settings(model: PreTrainedModel) -> tuple[int, int]:
    """(block_size, mask_token_id) of a converted model, from its config.

    Raises:
        ValueError: the model was not converted (its config lacks them).
    """
    block_size = getattr(model.config, "block_size", None)
    mask_id = getattr(model.config, "mask_token_id", None)
    if block_size is None or mask_id is None:
        raise ValueError("not a block-diffusion model: config lacks block_size / mask_token_id")
    return int(block_size), int(mask_id)


def decoding_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, int, int, int]:
    """(pad_id, eos_id, mask_id, block_size) for decoding a converted model with its tokenizer.

    Raises:
        ValueError: the tokenizer lacks a pad, eos or mask token, the model was
            not converted, or the model's mask id is not the tokenizer's.
    """
    pad_id, eos_id, mask_id = tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id
    if pad_id is None or eos_id is None or mask_id is None:
        raise ValueError("tokenizer needs pad, eos and mask tokens")
    block_size, model_mask = block_diffusion_settings(model)
    if model_mask != mask_id:
        raise ValueError(f"model's mask_token_id {model_mask} but the tokenizer's is {mask_id}")
    return int(pad_id), int(eos_id), int(mask_id), block_size


def convert_to_block_diffusion(
    ar_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, block_size: int
) -> PreTrainedModel:
    """A block-diffusion model initialised from the AR model: same class, same weights.

    The copy is a new instance (the AR model is left untouched); only its config
    changes: `config.block_size` and `config.mask_token_id`, which
    `save_pretrained` writes and `AutoModelForCausalLM.from_pretrained` reads
    back. When the tokenizer has no mask token, `<|mask|>` is added to it (the
    tokenizer is modified in place) and the copy's embeddings are resized to the
    tokenizer (mean initialisation of the new row); otherwise the state dict is
    exactly the AR model's.

    Args:
        ar_model: a causal LM (e.g. from `build_ar_model`) in any mode.
        tokenizer: the model's tokenizer.
        block_size: B >= 1, the number of tokens decoded together.
    Returns:
        The converted model, in the AR model's training/eval mode.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    # deepcopy keeps the class, the tied embedding/head and the generation config.
    model = copy.deepcopy(ar_model)
    if tokenizer.mask_token_id is None:
        tokenizer.add_special_tokens({"mask_token": MASK})
    mask_id = int(tokenizer.mask_token_id)
    if mask_id >= model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    model.config.block_size = int(block_size)
    model.config.mask_token_id = mask_id
    return model
