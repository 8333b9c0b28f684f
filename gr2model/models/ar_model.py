"""The AR re-ranker: a Hugging Face causal LM (Qwen3 architecture) built from a small config.

The model is a plain `Qwen3ForCausalLM` so that every checkpoint is a
`save_pretrained` folder that `AutoModelForCausalLM.from_pretrained` loads back,
and so that the block-diffusion conversion can copy its weights one to one.
A real pretrained causal LM can be used instead (`pretrained_path`); its
embeddings are resized to our tokenizer (semantic-id and special tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from gr2model.bounds import FieldRangeError, check

# SDPA is the fastest attention that runs on CPU and GPU alike, and it takes the
# 4D boolean masks that the block-diffusion model passes.
ATTN_IMPLEMENTATION = "sdpa"


@dataclass(frozen=True)
class ARModelConfig:
    """Size of the AR model built from scratch (all ignored when `pretrained_path` is set).

    `head_dim` is `hidden_size // num_heads`; `num_heads` must be a multiple of
    `num_kv_heads` (grouped-query attention).
    """

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    # A local save_pretrained folder of a causal LM (e.g. a real Qwen3). When set,
    # it is loaded instead of building from the fields above, and its embeddings
    # are resized to the tokenizer's vocabulary.
    pretrained_path: str | None = None

    def __post_init__(self) -> None:
        if self.pretrained_path is not None:
            # Checked before any work: from_pretrained would take a missing folder for a Hub
            # repo id and fail later with a download error (or download, where it may).
            folder = Path(self.pretrained_path)
            if not (folder / "config.json").is_file():
                what = "has no config.json" if folder.is_dir() else "does not exist"
                raise FieldRangeError(
                    "pretrained_path", f"{str(folder)!r} {what}: expected a local save_pretrained folder (model and tokenizer)"
                )
            return  # the size fields are ignored
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings"):
            check(self, name, ge=1)
        check(self, "rope_theta", gt=0)
        # Checked here too (not only when the model is built) so a params.yaml error shows before any work.
        if self.hidden_size % self.num_heads != 0:
            raise FieldRangeError("num_heads", f"{self.num_heads} does not divide hidden_size {self.hidden_size}")
        if self.num_heads % self.num_kv_heads != 0:
            raise FieldRangeError("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads {self.num_heads}")


def qwen3_config(
    cfg: ARModelConfig, vocab_size: int, *, pad_id: int, bos_id: int, eos_id: int
) -> Qwen3Config:
    """The transformers config of a from-scratch model of size `cfg`."""
    if cfg.hidden_size % cfg.num_heads != 0:
        raise ValueError(f"hidden_size {cfg.hidden_size} is not a multiple of num_heads {cfg.num_heads}")
    if cfg.num_heads % cfg.num_kv_heads != 0:
        raise ValueError(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        # Qwen3Config's default head_dim is 128 whatever the width; a small model
        # wants the usual hidden_size / num_heads.
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings,
        use_sliding_window=False,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )


def _set_special_ids(model: PreTrainedModel, *, pad_id: int, bos_id: int, eos_id: int) -> None:
    """Write our tokenizer's special ids into the model and generation configs.

    `generate` reads them from `generation_config`; a pretrained checkpoint comes
    with its own tokenizer's ids, which mean nothing in our vocabulary.
    """
    for conf in (model.config, model.generation_config):
        conf.pad_token_id = pad_id
        conf.bos_token_id = bos_id
        conf.eos_token_id = eos_id
    # The embedding's padding_idx (no gradient to the pad row) must follow our
    # pad id too, as it does in a model built from scratch.
    model.get_input_embeddings().padding_idx = pad_id


def build_ar_model(
    cfg: ARModelConfig, vocab_size: int, *, pad_id: int, bos_id: int, eos_id: int, seed: int = 0
) -> PreTrainedModel:
    """A `Qwen3ForCausalLM` from scratch (or the pretrained one at `cfg.pretrained_path`, resized).

    Args:
        cfg: model size, or the pretrained folder.
        vocab_size: the tokenizer's vocabulary size; the embedding and head have
            this many rows.
        pad_id, bos_id, eos_id: the tokenizer's special ids, written into the
            model's config and generation config.
        seed: seeds the random initialisation (and the new embedding rows of a
            resized pretrained model); the global RNG state is left as it was.
    Returns:
        The model in float32, eval mode, with `attn_implementation="sdpa"`. Its
        forward maps input ids (B, T) to logits (B, T, vocab_size).
    """
    # fork_rng: building a model must not shift the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.pretrained_path is not None:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.pretrained_path, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32
            )
            if model.get_input_embeddings().weight.shape[0] != vocab_size:
                # mean_resizing: new rows start at the old embeddings' mean, so the
                # pretrained next-token distribution barely moves.
                model.resize_token_embeddings(vocab_size, mean_resizing=True)
        else:
            config = qwen3_config(cfg, vocab_size, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)
            config._attn_implementation = ATTN_IMPLEMENTATION
            model = Qwen3ForCausalLM(config)
            model.generation_config = GenerationConfig.from_model_config(config)
    _set_special_ids(model, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)
    return model.eval()


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied embedding and head counted once)."""
    # model.parameters() already yields a shared tensor once; the data_ptr set
    # also covers weights tied by aliasing the same storage.
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    return total
