"""The AR model builder: a Qwen3 causal LM from a small config, or a local pretrained one resized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from gr2model.models.ar_model import ARModelConfig, build_ar_model, count_parameters

TINY = ARModelConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
    max_position_embeddings=64,
)
VOCAB = 40
IDS = {"pad_id": 0, "bos_id": 1, "eos_id": 2}



def _logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_builds_qwen3_of_the_configured_size() -> None:
    model = build_ar_model(TINY, VOCAB, **IDS)
    assert isinstance(model, Qwen3ForCausalLM)
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (VOCAB, 32, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 8)
    assert c._attn_implementation == "sdpa"
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id) == (0, 1, 2)
    assert model.generation_config.eos_token_id == 2
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert not model.training
    logits = _logits(model, torch.randint(0, VOCAB, (3, 7)))
    assert logits.shape == (3, 7, VOCAB)


def test_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_ar_model(TINY, VOCAB, **IDS, seed=5)
    assert torch.equal(torch.rand(1), expected_next)
    b = build_ar_model(TINY, VOCAB, **IDS, seed=5)
    c = build_ar_model(TINY, VOCAB, **IDS, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])


def test_save_pretrained_reloads_with_auto_class(tmp_path: Path) -> None:
    model = build_ar_model(TINY, VOCAB, **IDS)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, Qwen3ForCausalLM)
    ids = torch.randint(3, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding goes through the mask path too
    assert torch.equal(_logits(model, ids, mask), _logits(loaded, ids, mask))
    assert loaded.generation_config.eos_token_id == 2


def test_pretrained_path_is_loaded_and_resized(tmp_path: Path) -> None:
    base = build_ar_model(TINY, VOCAB, **IDS, seed=3)
    base.save_pretrained(tmp_path)
    model = build_ar_model(
        ARModelConfig(pretrained_path=str(tmp_path)), VOCAB + 10, pad_id=41, bos_id=42, eos_id=43
    )
    assert model.config.vocab_size == VOCAB + 10
    assert model.lm_head.weight.shape == (VOCAB + 10, 32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (model.config.pad_token_id, model.generation_config.eos_token_id) == (41, 43)
    assert model.get_input_embeddings().padding_idx == 41
    # The old tokens keep their weights: same logits over the old vocabulary.
    ids = torch.randint(0, VOCAB, (2, 6))
    assert torch.allclose(_logits(base, ids), _logits(model, ids)[..., :VOCAB])


def test_count_parameters_counts_tied_weights_once() -> None:
    tied = build_ar_model(TINY, VOCAB, **IDS)
    untied = build_ar_model(ARModelConfig(**{**TINY.__dict__, "tie_word_embeddings": False}), VOCAB, **IDS)
    assert count_parameters(untied) - count_parameters(tied) == VOCAB * TINY.hidden_size
    assert count_parameters(untied) == sum(p.numel() for p in untied.parameters())


def test_rejects_heads_that_do_not_divide() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_ar_model(ARModelConfig(**{**TINY.__dict__, "num_kv_heads": 3}), VOCAB, **IDS)
