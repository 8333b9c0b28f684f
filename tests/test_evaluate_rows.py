"""How `evaluate` decodes its rows: the headline without a grammar, `gr2-no-reasoning`, top-1 agreement."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from gr2model.decoding.ar_decode import DecodeOutput
from gr2model.eval.rerank_eval import lm_rerank, prompts_of
from gr2model.task.rerank_format import EOS, FormatConfig, build_response, no_reasoning_prefix
from tasks.evaluate import EvaluateConfig, _decode_eval, add_agreement, top1_agreement

from test_constrained import FMT, PROMPT, Scripted, answer_ids
from tiny import toy_items, toy_tokenizer

REASONING_FIRST = FormatConfig(history_len=0, with_attributes=False, answer="index", answer_first=False)
LISTS = pl.DataFrame({"history": [[1], [2, 3]], "candidates": [[1, 2, 3, 4], [4, 3, 2, 1]], "target": [2, 3]})


@pytest.fixture(scope="module")
def tok():
    return toy_tokenizer()


def test_no_reasoning_row_decodes_from_the_prompt_and_an_empty_explanation(tok) -> None:
    """The forced prefix is what the decoder is given after each prompt, and what the parser
    reads before the decoded answer: an empty explanation, then the model's own ranking."""
    seen: list[list[int]] = []
    prefix = no_reasoning_prefix(REASONING_FIRST)
    full = build_response([], [2, 1, 4, 3], toy_items(), fmt=REASONING_FIRST, candidates=[1, 2, 3, 4])
    answer = tok.convert_tokens_to_ids(f"{full[len(prefix):]} {EOS}".split())

    def decoder(model, prompts, *, pad_id, eos_id, max_new_tokens, **_):
        seen.extend(list(p) for p in prompts)
        return DecodeOutput([list(answer) for _ in prompts], nfe=1, generated_tokens=len(answer) * len(prompts), seconds=1.0)

    out = lm_rerank(None, tok, LISTS, toy_items(), REASONING_FIRST, decoder=decoder, response_prefix=prefix)
    prompts = prompts_of(LISTS, toy_items(), REASONING_FIRST)
    expected = sorted(tok(f"{p} {prefix}", add_special_tokens=False)["input_ids"] for p in prompts)
    assert sorted(seen) == expected
    tail = tok.convert_tokens_to_ids(prefix.split())
    assert all(p[-len(tail) :] == tail and p[: -len(tail)] in [tok(q, add_special_tokens=False)["input_ids"] for q in prompts] for p in seen)
    assert [p.explanation for p in out.parsed] == ["", ""]
    assert out.parsed[0].valid_permutation and out.parsed[0].ranking == [2, 1, 4, 3]
    # The second list's candidates are in another order: the same positions name other items.
    assert out.parsed[1].ranking == [3, 4, 1, 2]
    assert out.sequences[0] == answer  # the decoded tokens alone, after the forced prefix


def test_headline_row_counts_what_the_model_wrote_and_the_grammar_row_is_labelled(tok) -> None:
    """A model that repeats a candidate: its headline row (no grammar) counts the answer invalid
    (the incoming order is the fallback); the `+grammar` decode repairs it and says so."""
    lists = LISTS.head(1)
    prompt_len = len(tok(prompts_of(lists, toy_items(), FMT)[0], add_special_tokens=False)["input_ids"])
    broken = answer_ids(tok, [2, 2, 4, 3], ["because"])  # a duplicate: not a permutation

    class Writer(Scripted):  # writes `broken` after a prompt of this length
        def forward(self, input_ids, position_ids=None, **kw):
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1])[None].expand(input_ids.shape[0], -1)
            return super().forward(input_ids, position_ids=position_ids - prompt_len + len(PROMPT), **kw)

    model = Writer(broken, len(tok))
    cfg = EvaluateConfig(max_new_tokens=40)
    m, ranks, out = _decode_eval("gr2", model, tok, lists, toy_items(), FMT, cfg)
    assert m["valid_permutation_rate"] == 0.0 and "grammar_changed_rate" not in m
    assert out.parsed[0].error == "duplicate" and out.parsed[0].ranking == [1, 2, 3, 4]
    g, _, gout = _decode_eval("gr2+grammar", model, tok, lists, toy_items(), FMT, cfg, constrained=True)
    assert g["valid_permutation_rate"] == 1.0 and g["grammar_changed_rate"] == 1.0


def test_top1_agreement_on_hand_built_rankings() -> None:
    assert top1_agreement([3, 1, 2, 2], [3, 2, 2, 5]) == 0.5
    assert top1_agreement([3], [3, 9, 9]) == 1.0  # a row scored on the first examples only
    with pytest.raises(ValueError, match="reference"):
        top1_agreement([1, 2, 3], [1, 2])
    results = {"gr2": {"test": {}}, "dgr2": {"test": {}}, "gr2-no-reasoning": {"test": {}}}
    add_agreement(results, {"gr2": {"test": [3, 1, 2, 2]}, "dgr2": {"test": [3, 1, 5, 2]}, "gr2-no-reasoning": {"test": [1, 1, 1, 1]}})
    assert results["dgr2"]["test"]["top1_agreement_vs_gr2"] == 0.75
    assert results["gr2-no-reasoning"]["test"]["top1_agreement_vs_gr2"] == 0.25
    assert "top1_agreement_vs_gr2" not in results["gr2"]["test"]
