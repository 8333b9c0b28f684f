"""Mid-training (GR2's recipe): the LM learns the items as vocabulary before SFT teaches it to reason.

Every example is a (prompt, response) pair in the format's whitespace-token
text (`gr2model.task.rerank_format`), trained with the SFT machinery (`encode_example`,
`collate_right_padded`, `run_train_loop`: loss on the response only). Built from
the TRAINING part of each sequence only (`split["train"]`): no validation or test
target is ever written, and items that occur only as someone's validation or
test target are never named at all (they stay cold, as they are for the
pre-ranker).

Tasks (`MIDTRAIN_WORDS` are the words they add to the tokenizer):

- ``sequence`` (next-item prediction), one example per user::

      <|user|> sequence : SID_1            ->  SID_2 SID_3 ... SID_n

  The response is the rest of the sequence, so one causal pass trains every
  next-item target of the user (each item conditioned on all before it): about
  4 tokens per training interaction per epoch (~0.7M on Beauty) instead of
  O(n^2) tokens for one example per target. The end token after the last item
  gets no loss (the sequence did not end there; it was cut for validation).
  A training part longer than `max_items` items is cut into windows whose
  prompt repeats the previous `max_items // 2` items as context, so every
  target is trained exactly once and never with an empty context.
- ``item_attributes`` / ``attributes_item`` (item grounding), every item of the
  training parts that has attributes::

      <|user|> item : SID <|assistant|>          ->  attributes : A1 A2 ...
      <|user|> attributes : A1 A2 ... <|assistant|>  ->  item : SID

- ``persona`` (user grounding): the last `persona_history` training items ->
  the attributes that occur in at least `persona_min_count` of them (most
  frequent first)::

      <|user|> persona : SID ... SID <|assistant|>  ->  attributes : A ...

- ``trace`` (language modelling of the trace vocabulary): the kept teacher
  explanations::

      <|user|> trace : <|assistant|>  ->  w1 w2 ... wn

Evaluation is generative retrieval: the prompt `<|user|> sequence : SID ...
SID` (the training history, plus the validation item for test) and a
constrained beam search over the trie of existing semantic ids
(`constrained_beam_search`), so every returned id is an item.
"""

from __future__ import annotations

import logging
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from gr2model.decoding.ar_decode import left_pad
from gr2model.bounds import check
from gr2model.task.metrics import rank_in_lists, ranking_metrics
from gr2model.task.rerank_format import ASSISTANT, POSITION_RE, USER, ItemText
from gr2model.training.sft import IGNORE_INDEX, SFTConfig, explanation_span, encode_example

__all__ = [
    "MIDTRAIN_WORDS",
    "TASKS",
    "MidtrainTasks",
    "NextItemEvalConfig",
    "Example",
    "build_examples",
    "explanation_of",
    "encode_examples",
    "sequence_prompt",
    "sid_table",
    "constrained_beam_search",
    "score_items_exact",
    "next_item_eval",
]

log = logging.getLogger(__name__)

# The task words (all must be tokens: `build_tokenizer(items, [*TRACE_WORDS, *MIDTRAIN_WORDS])`).
MIDTRAIN_WORDS: tuple[str, ...] = ("attributes", "item", "persona", "sequence", "trace")
TASKS: tuple[str, ...] = ("sequence", "item_attributes", "attributes_item", "persona", "trace")

_SID_TEXT_RE = re.compile(r"<a_\d+> <b_\d+> <c_\d+> <d_\d+>")


@dataclass(frozen=True)
class MidtrainTasks:
    """Which mid-training tasks to build, and their caps.

    sequence, item_attributes, attributes_item, persona, trace: switch each task on/off.
    max_items: items per sequence example (longer training parts become windows;
        4 tokens per item, so 200 items fit SFTConfig.max_length 1024).
    max_attributes: attributes written per item (and per persona answer); 0 = all.
    persona_history: training items written in a persona prompt (the last ones).
    persona_min_count: an attribute is part of the persona if it occurs in at
        least this many of those items.
    max_traces: kept teacher explanations trained on (0 = all).
    max_examples_per_task: cap on every task's examples (0 = no cap; smoke runs).
    seed: which examples a cap keeps.
    """

    sequence: bool = True
    item_attributes: bool = True
    attributes_item: bool = True
    persona: bool = True
    trace: bool = True
    max_items: int = 200
    max_attributes: int = 0
    persona_history: int = 10
    persona_min_count: int = 2
    max_traces: int = 0
    max_examples_per_task: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        check(self, "max_items", ge=2)
        for name in ("persona_history", "persona_min_count"):
            check(self, name, ge=1)
        for name in ("max_attributes", "max_traces", "max_examples_per_task", "seed"):  # caps: 0 = all
            check(self, name, ge=0)


@dataclass(frozen=True)
class NextItemEvalConfig:
    """Next-item generative retrieval on validation and test.

    eval_users: users evaluated per split (a seeded sample; 0 = all).
    beam_width: beams of the constrained beam search (the list length; >= 10).
    batch_size: users per beam-search batch.
    exclude_history: drop the user's history items from the list before cutting
        at 10, as the pre-ranker's full-ranking metrics do (comparable numbers).
    seed: which users the sample takes.
    """

    eval_users: int = 2000
    beam_width: int = 20
    batch_size: int = 32
    exclude_history: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        check(self, "beam_width", ge=10, why="R@10 is reported")
        check(self, "batch_size", ge=1)
        for name in ("eval_users", "seed"):  # eval_users 0 = all
            check(self, name, ge=0)


@dataclass(frozen=True)
class Example:
    """One mid-training text pair. user_id: the user it was built from (None for item and trace tasks)."""

    task: str
    prompt: str
    response: str
    user_id: int | None = None


# --------------------------------------------------------------------- building


def _sids(items: ItemText, seq: Iterable[int]) -> list[str]:
    return [t for i in seq for t in items.sid_tokens(i)]


def sequence_prompt(history: Sequence[int], items: ItemText, max_items: int) -> str:
    """The next-item prompt: `<|user|> sequence : SID ... SID` of the last `max_items - 1` history items."""
    kept = [i for i in history if i in items][-(max_items - 1) :]
    return " ".join([USER, "sequence", ":", *_sids(items, kept)])


def _sequence_examples(user: int, seq: list[int], items: ItemText, max_items: int) -> list[Example]:
    seq = [i for i in seq if i in items]
    if len(seq) < 2:
        return []
    ctx = max_items // 2
    out = []
    start, end = 1, min(len(seq), max_items)
    while start < len(seq):
        context = seq[max(0, start - ctx) : start] if start > 1 else seq[:1]
        prompt = " ".join([USER, "sequence", ":", *_sids(items, context)])
        out.append(Example("sequence", prompt, " ".join(_sids(items, seq[start:end])), user))
        start, end = end, min(len(seq), end + max_items - ctx)
    return out


def _attrs(row_attrs: Sequence[int] | None, cap: int) -> list[str]:
    attrs = [f"<attr_{int(a)}>" for a in (row_attrs or ())]
    return attrs[:cap] if cap else attrs


def _cap(examples: list[Example], cap: int, rng: random.Random) -> list[Example]:
    if cap and len(examples) > cap:
        return rng.sample(examples, cap)
    return examples


def build_examples(
    split: pl.DataFrame,
    items_table: pl.DataFrame,
    cfg: MidtrainTasks,
    explanations: Sequence[str] = (),
) -> dict[str, list[Example]]:
    """Every enabled task's examples, from the training parts only.

    Args:
        split: the leave-one-out split (user_id, train, valid, test); only
            `train` is read.
        items_table: the prepared items table (item_id, sid, attributes).
        explanations: teacher explanation texts (the `trace` task); one citing
            an item outside the training parts is dropped.
    Returns:
        {task: examples} for the tasks of `TASKS` that are switched on.
    """
    items = ItemText(items_table)
    rng = random.Random(cfg.seed)
    users = split["user_id"].to_list()
    trains = split["train"].to_list()
    seen = {int(i) for seq in trains for i in seq if int(i) in items}
    attrs_of = {
        int(i): list(a or ())
        for i, a in zip(items_table["item_id"].to_list(), items_table["attributes"].to_list())
    }
    out: dict[str, list[Example]] = {}
    if cfg.sequence:
        out["sequence"] = [
            e for u, seq in zip(users, trains) for e in _sequence_examples(int(u), [int(i) for i in seq], items, cfg.max_items)
        ]
    grounded = sorted(i for i in seen if attrs_of.get(i))
    if cfg.item_attributes:
        out["item_attributes"] = [
            Example("item_attributes", " ".join([USER, "item", ":", *items.sid_tokens(i), ASSISTANT]),
                    " ".join(["attributes", ":", *_attrs(attrs_of[i], cfg.max_attributes)]))
            for i in grounded
        ]  # fmt: skip
    if cfg.attributes_item:
        out["attributes_item"] = [
            Example("attributes_item", " ".join([USER, "attributes", ":", *_attrs(attrs_of[i], cfg.max_attributes), ASSISTANT]),
                    " ".join(["item", ":", *items.sid_tokens(i)]))
            for i in grounded
        ]  # fmt: skip
    if cfg.persona:
        persona = []
        for u, seq in zip(users, trains):
            hist = [int(i) for i in seq if int(i) in items][-cfg.persona_history :]
            counts = Counter(a for i in hist for a in set(attrs_of.get(i, ())))
            recurring = sorted((a for a, n in counts.items() if n >= cfg.persona_min_count), key=lambda a: (-counts[a], a))
            if not recurring:
                continue
            persona.append(
                Example("persona", " ".join([USER, "persona", ":", *_sids(items, hist), ASSISTANT]),
                        " ".join(["attributes", ":", *_attrs(recurring, cfg.max_attributes)]), int(u))
            )  # fmt: skip
        out["persona"] = persona
    if cfg.trace:
        traces, dropped = [], 0
        for text in explanations:
            # A cited position (<pos_k>) means nothing without the candidate list this task
            # has no prompt for: the language of the reasoning is learned without it.
            words = [w for w in text.split() if not POSITION_RE.fullmatch(w)]
            cited = [items.item_of_sid(m.group(0)) for m in _SID_TEXT_RE.finditer(" ".join(words))]
            if not words or any(c is None or c not in seen for c in cited):
                dropped += 1
                continue
            traces.append(Example("trace", " ".join([USER, "trace", ":", ASSISTANT]), " ".join(words)))
        if dropped:
            log.info("trace: %d explanations dropped (empty, or citing an item outside the training parts)", dropped)
        if cfg.max_traces:
            traces = traces[: cfg.max_traces]
        out["trace"] = traces
    return {task: _cap(ex, cfg.max_examples_per_task, rng) for task, ex in out.items()}


def explanation_of(response: str) -> str:
    """The explanation words of a re-ranking response ('' when it has none)."""
    span = explanation_span(response)
    return response[span[0] : span[1]] if span else ""


def encode_examples(
    tok: PreTrainedTokenizerBase, examples: Sequence[Example], cfg: SFTConfig, *, progress: bool = False
) -> list[dict[str, list]]:
    """`encode_example` of each, adjusted for mid-training.

    - sequence examples: the end token gets no label (the training part was cut
      there for validation; it is not where the sequence ends), and their tokens
      are flagged in the `reasoning` channel, so the loop's `reasoning_loss` is
      the next-item loss and its `answer_loss` the loss of the other tasks.
    - every response token weighs `cfg.answer_weight` (no explanation span here).
    """
    out = []
    eos = tok.eos_token_id
    for ex in tqdm(examples, desc="encode", unit="ex", disable=not progress, leave=False):
        enc = encode_example(tok, ex.prompt, ex.response, cfg)
        if ex.task == "sequence":
            if enc["input_ids"][-1] == eos:  # not cut by max_length (no item token is the end token)
                enc["labels"][-1] = IGNORE_INDEX
                enc["weights"][-1] = 0.0
            enc["reasoning"] = [int(lab != IGNORE_INDEX) for lab in enc["labels"]]
        if any(w > 0 for w in enc["weights"][1:]):
            out.append(enc)
    return out


# --------------------------------------------------------------- beam search


def sid_table(tok: PreTrainedTokenizerBase, items_table: pl.DataFrame) -> tuple[np.ndarray, torch.Tensor]:
    """(item ids (N,), their semantic ids as token ids (N, 4) long) of every item with a semantic id."""
    items = ItemText(items_table)
    ids = [int(i) for i in items_table["item_id"].to_list() if int(i) in items]
    table = [tok.convert_tokens_to_ids(items.sid_tokens(i)) for i in ids]
    for i, row in zip(ids, table):
        if tok.convert_ids_to_tokens(row) != items.sid_tokens(i):
            raise ValueError(f"item {i}: a semantic-id token is not a single token of the tokenizer")
    return np.asarray(ids, dtype=np.int64), torch.as_tensor(table, dtype=torch.long)


@dataclass(frozen=True)
class _Trie:
    """The semantic-id prefixes of each length: prefixes[k] (Q_k, k+1) token ids (unique),
    parent[k] (Q_k,) the index of each prefix's first k tokens in prefixes[k-1],
    leaf_item (Q_3,) row of `sids` of each full id."""

    prefixes: list[torch.Tensor]
    parent: list[torch.Tensor]
    leaf_item: torch.Tensor


def _trie(sids: torch.Tensor) -> _Trie:
    prefixes, parent, inverse = [], [], []
    for k in range(sids.shape[1]):
        uniq, inv = torch.unique(sids[:, : k + 1], dim=0, return_inverse=True)
        prefixes.append(uniq)
        inverse.append(inv)
        if k == 0:
            parent.append(torch.zeros(len(uniq), dtype=torch.long))
        else:
            par = torch.empty(len(uniq), dtype=torch.long)
            par[inv] = inverse[k - 1]  # every item of one prefix shares its parent
            parent.append(par)
    leaf = torch.empty(len(prefixes[-1]), dtype=torch.long)
    leaf[inverse[-1]] = torch.arange(len(sids))
    if len(prefixes[-1]) != len(sids):
        raise ValueError("two items share a semantic id")
    return _Trie(prefixes, parent, leaf)


@torch.no_grad()
def constrained_beam_search(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], sids: torch.Tensor, beam_width: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `beam_width` most likely existing semantic ids after each prompt.

    Beam search over the trie of `sids`: at level k only the tokens that extend
    a beam's prefix to an existing id prefix are allowed; a beam's score is the
    sum of its tokens' log-probabilities under the full softmax (not
    renormalised over the allowed tokens). The prompt is run once and its cache
    repeated for the beams; each level re-feeds the beams' prefix (k <= 3
    tokens) on top of it and crops the cache back, so no cache reordering is
    needed.

    Args:
        model: a causal LM; prompts: B token id lists (no padding).
        sids: (N, L) long token ids of the items' semantic ids (`sid_table`).
    Returns:
        rows (B, W) long: row of `sids` of each result, best first, -1 where fewer
        than W ids exist; scores (B, W) float: their summed log-probabilities.
    """
    device = next(model.parameters()).device
    trie = _trie(sids.cpu())
    prefixes = [p.to(device) for p in trie.prefixes]
    parents = [p.to(device) for p in trie.parent]
    ids, mask = left_pad(prompts, pad_id, device)
    batch, width = ids.shape
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # (B, V)
    # Level 0: one beam per allowed first token.
    cand = logp[:, prefixes[0][:, 0]]  # (B, Q0)
    w0 = min(beam_width, cand.shape[1])
    scores, beam_prefix = cand.topk(w0, dim=-1)
    if w0 < beam_width:  # dummy beams that can never win
        scores = torch.cat([scores, scores.new_full((batch, beam_width - w0), -torch.inf)], dim=1)
        beam_prefix = torch.cat([beam_prefix, beam_prefix.new_zeros((batch, beam_width - w0))], dim=1)
    cache.batch_repeat_interleave(beam_width)
    mask_rep = mask.repeat_interleave(beam_width, dim=0)
    last_pos = pos[:, -1].repeat_interleave(beam_width)
    n_levels = sids.shape[1]
    for k in range(1, n_levels):
        tokens = prefixes[k - 1][beam_prefix.reshape(-1)]  # (B*W, k)
        step_mask = torch.cat([mask_rep, mask_rep.new_ones((len(tokens), k))], dim=1)
        step_pos = last_pos[:, None] + torch.arange(1, k + 1, device=device)[None]
        step = model(
            input_ids=tokens, attention_mask=step_mask, position_ids=step_pos, cache=cache, use_cache=True, logits_to_keep=1
        )
        cache.crop(-k)  # back to the prompt alone
        logp = torch.log_softmax(step.logits[:, -1].float(), dim=-1)  # (B*W, V)
        # Every extension q of level k: allowed for the beam whose prefix is its parent.
        val = scores.reshape(-1, 1) + logp[:, prefixes[k][:, k]]  # (B*W, Q_k)
        allowed = parents[k][None, :] == beam_prefix.reshape(-1, 1)
        val = val.masked_fill(~allowed, -torch.inf).view(batch, -1)
        n_q = prefixes[k].shape[0]
        scores, flat = val.topk(beam_width, dim=-1)
        beam_prefix = flat % n_q
    rows = trie.leaf_item.to(device)[beam_prefix]
    rows = rows.masked_fill(torch.isinf(scores), -1)
    return rows.cpu(), scores.cpu()


@torch.no_grad()
def score_items_exact(model: PreTrainedModel, prompt: Sequence[int], sids: torch.Tensor) -> torch.Tensor:
    """log p(sid | prompt) of every item by teacher forcing (N,): the reference the beam search approximates."""
    device = next(model.parameters()).device
    n = len(sids)
    ids = torch.cat([torch.as_tensor(list(prompt), dtype=torch.long).expand(n, -1), sids], dim=1).to(device)
    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
    p = len(prompt)
    steps = logp[:, p - 1 : p - 1 + sids.shape[1]]  # position i-1 predicts token i
    return steps.gather(-1, sids.to(device)[..., None]).squeeze(-1).sum(-1).cpu()


def next_item_eval(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    split: pl.DataFrame,
    items_table: pl.DataFrame,
    which: str,
    cfg: NextItemEvalConfig,
    max_items: int,
) -> dict[str, float]:
    """R@5/10 and NDCG@5/10 of the held-out item by constrained beam search.

    History: the training part (`which="valid"`) or training part + validation
    item (`which="test"`); the target is the split's item. Users whose target
    has no semantic id are skipped (counted in `n_skipped`).
    """
    if which not in ("valid", "test"):
        raise ValueError(f"which must be 'valid' or 'test', got {which!r}")
    items = ItemText(items_table)
    item_ids, sids = sid_table(tok, items_table)
    users = list(zip(split["train"].to_list(), split["valid"].to_list(), split["test"].to_list()))
    rows = [(list(tr) + ([va] if which == "test" else []), va if which == "valid" else te) for tr, va, te in users]
    skipped = sum(1 for _, t in rows if t not in items)
    rows = [r for r in rows if r[1] in items]
    if cfg.eval_users and len(rows) > cfg.eval_users:
        rows = random.Random(cfg.seed).sample(rows, cfg.eval_users)
    # Similar lengths per batch: less padding (the metrics do not depend on order).
    rows.sort(key=lambda r: len(r[0]))
    pad_id = tok.pad_token_id
    lists = np.full((len(rows), 10), -1, dtype=np.int64)
    for start in tqdm(range(0, len(rows), cfg.batch_size), desc=f"next-item {which}", unit="batch"):
        chunk = rows[start : start + cfg.batch_size]
        prompts = [tok(sequence_prompt(h, items, max_items), add_special_tokens=False)["input_ids"] for h, _ in chunk]
        found, _ = constrained_beam_search(model, prompts, sids, cfg.beam_width, pad_id)
        for j, (hist, _) in enumerate(chunk):
            banned = set(hist) if cfg.exclude_history else set()
            ranked = [int(item_ids[r]) for r in found[j].tolist() if r >= 0 and int(item_ids[r]) not in banned][:10]
            lists[start + j, : len(ranked)] = ranked
    targets = np.asarray([t for _, t in rows], dtype=np.int64)
    metrics = ranking_metrics(rank_in_lists(lists, targets), (5, 10), (5, 10)) if len(rows) else {"n": 0}
    metrics["n_skipped"] = skipped
    return metrics
