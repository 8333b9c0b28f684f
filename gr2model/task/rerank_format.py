"""The re-ranking task as text: prompts, responses, the strict parser and the metrics.

One format for the whole project: teacher traces, SFT, the RL reward, AR and
diffusion decoding and evaluation all go through `build_prompt`,
`build_response` and `parse_response`, so a change here changes every stage.

Every token is separated from the next by a single space, so a whitespace split
is the exact tokenization (`gr2model.task.tokenizer` relies on it).

Items are written by their 4-token semantic id, one token per level::

    <a_12> <b_5> <c_200> <d_3>

optionally followed by up to `max_attributes` attribute tokens in parentheses,
`( <attr_1> <attr_9> )`. An item without attributes to write gets no
parentheses at all (two tokens saved, and nothing to learn from an empty pair).

Prompt::

    <|user|> history : ITEM ... ITEM candidates : ITEM ... ITEM <|assistant|>

(the last `history_len` history items, oldest first; the K candidates in the
incoming pre-rank order).

Response (valid JSON once the end token is removed)::

    { "explanation" : " w1 w2 ... wn " , "recommendations" : [ " <a_1> <b_2> <c_3> <d_4> " , ... ] }

followed by `<|eos|>` (not part of the JSON). `"explanation"` and
`"recommendations"` are single tokens, quote marks included; a lone `"` and
`{ } [ ] : ,` are tokens too.

Two answer formats (`FormatConfig.answer`):

- `sid` (the paper's): each recommendation is a candidate's 4-token semantic id;
- `index`: each candidate in the prompt is preceded by its incoming position,
  `candidates : <pos_1> ITEM <pos_2> ITEM ...`, and each recommendation is one
  position token, `[ " <pos_3> " , " <pos_1> " , ... ]`. A small model trained
  from scratch copies one token per item far more reliably than four (measured:
  README "The answer format"); the explanation cites candidates as `<pos_k>`
  followed by their semantic id (history items by semantic id alone).

The project's re-ranker reasons first (`answer_first=False`): the explanation
comes before the recommendations and, in the index format, cites each
candidate it weighs as its position token followed by its semantic id, in the
order it ranks them, so the ranking the answer copies was decided inside the
reasoning. `FormatConfig.answer_first` is the rank-first fast mode: it writes
`"recommendations"` before `"explanation"`, so the ranking is decided right
after the prompt and cannot depend on the reasoning (a decoder may stop after
it). The parser judges both orders alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from gr2model.task.metrics import rank_in_lists, ranking_metrics

__all__ = [
    "PAD",
    "UNK",
    "BOS",
    "EOS",
    "USER",
    "ASSISTANT",
    "MASK",
    "SPECIAL_TOKENS",
    "EXPLANATION_KEY",
    "RECOMMENDATIONS_KEY",
    "JSON_TOKENS",
    "PROMPT_WORDS",
    "SID_LEVELS",
    "RERANK_METRIC_NAMES",
    "FormatConfig",
    "ItemText",
    "ParsedResponse",
    "sid_token",
    "attr_token",
    "pos_token",
    "POSITION_RE",
    "evidence_token",
    "MAX_POSITIONS",
    "MAX_EVIDENCE",
    "EVIDENCE_LEVELS",
    "ANSWER_FORMATS",
    "build_prompt",
    "evidence_levels",
    "evidence_of",
    "fit_evidence_bins",
    "build_response",
    "build_full_text",
    "no_reasoning_prefix",
    "parse_response",
    "rerank_metrics",
    "target_ranks",
]

PAD = "<|pad|>"
UNK = "<|unk|>"
BOS = "<|bos|>"
EOS = "<|eos|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
# The block-diffusion model's mask token, reserved from the start so the
# vocabulary (and so every checkpoint's embedding table) never changes later.
MASK = "<|mask|>"
# Fixed order: ids 0..6 in a tokenizer built by `gr2model.task.tokenizer`.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, BOS, EOS, USER, ASSISTANT, MASK)

EXPLANATION_KEY = '"explanation"'
RECOMMENDATIONS_KEY = '"recommendations"'
# `"explanation" : "`: how the explanation member opens, and with the object's brace how a
# reasoning-first response opens (the prefix a no-reasoning decode is forced through and the
# point from which GR2's NLL of the reasoning is read).
EXPLANATION_OPENING: tuple[str, ...] = (EXPLANATION_KEY, ":", '"')
REASONING_FIRST_OPENING: tuple[str, ...] = ("{", *EXPLANATION_OPENING)
JSON_TOKENS: tuple[str, ...] = ("{", "}", "[", "]", ":", ",", '"', EXPLANATION_KEY, RECOMMENDATIONS_KEY)
PROMPT_WORDS: tuple[str, ...] = ("history", "candidates", "(", ")")
SID_LEVELS: tuple[str, ...] = ("a", "b", "c", "d")

RERANK_METRIC_NAMES: tuple[str, ...] = (
    "recall@1",
    "recall@3",
    "recall@5",
    "ndcg@3",
    "ndcg@5",
    "valid_format_rate",
    "valid_permutation_rate",
    "copy_incoming_rate",
    "n",
)

# Position tokens <pos_1>..<pos_MAX_POSITIONS> exist in every vocabulary (the
# index answer format names candidates by them), so switching formats never
# changes the tokenizer.
MAX_POSITIONS = 50
ANSWER_FORMATS: tuple[str, ...] = ("sid", "index")
# Evidence tokens <ev{f}_{b}>: the level b (0..EVIDENCE_LEVELS-1) of evidence
# feature f (1..MAX_EVIDENCE) of a candidate, written before its item tokens.
MAX_EVIDENCE = 8
EVIDENCE_LEVELS = 8

# Canonical code: no sign, no leading zero (so "<a_01>" is not a second spelling of "<a_1>").
_CODE = r"(0|[1-9][0-9]*)"
_SID_RE = re.compile(r"\s*".join(rf"<{lvl}_{_CODE}>" for lvl in SID_LEVELS))
_SPECIAL_RE = re.compile(r"<\|[^|\s]*\|>")
POSITION_RE = re.compile(r"<pos_([1-9][0-9]*)>")  # a candidate's position token, `<pos_k>` (group 1: k)
_ID_TOKEN_RE = re.compile(r"<(?:[abcd]|attr|pos|ev[0-9]+)_[0-9]+>")


def _canonical_explanation(text: str) -> str:
    # A BPE decode may glue id tokens to their neighbours ("likes<a_1><b_2>");
    # spacing them out gives the same explanation whatever tokenizer wrote it.
    return " ".join(_ID_TOKEN_RE.sub(lambda m: f" {m.group(0)} ", text).split())


def sid_token(level: str, code: int) -> str:
    """`sid_token("a", 12) == "<a_12>"`: the token of one semantic-id level."""
    return f"<{level}_{code}>"


def attr_token(attribute: int) -> str:
    """`attr_token(37) == "<attr_37>"`."""
    return f"<attr_{attribute}>"


def pos_token(position: int) -> str:
    """`pos_token(3) == "<pos_3>"`: the third candidate of the incoming order (1-based)."""
    if not 1 <= position <= MAX_POSITIONS:
        raise ValueError(f"position {position} outside 1..{MAX_POSITIONS}")
    return f"<pos_{position}>"


def evidence_token(feature: int, level: int) -> str:
    """`evidence_token(2, 5) == "<ev2_5>"`: level 5 of the candidate's second evidence feature."""
    if not 1 <= feature <= MAX_EVIDENCE:
        raise ValueError(f"evidence feature {feature} outside 1..{MAX_EVIDENCE}")
    if not 0 <= level < EVIDENCE_LEVELS:
        raise ValueError(f"evidence level {level} outside 0..{EVIDENCE_LEVELS - 1}")
    return f"<ev{feature}_{level}>"


@dataclass(frozen=True)
class FormatConfig:
    """How prompts are written.

    history_len: keep the last this many history items (0 writes none).
    with_attributes: write each item's attributes after its semantic id.
    max_attributes: at most this many attributes per item (the first ones).
    answer: "sid" (recommendations are semantic ids) or "index" (candidates are
        numbered in the prompt and recommendations are position tokens).
    evidence: names of per-candidate evidence features written into the prompt
        (empty: none), one `<ev{f}_{b}>` token each before the candidate's item
        tokens; the values come with the lists (`build_prompt(evidence=...)`).
    evidence_bins: for each evidence feature, the ascending thresholds that cut
        its values into levels (level = how many thresholds the value reaches;
        at most EVIDENCE_LEVELS - 1 thresholds), fitted on the training lists.
    answer_first: the response writes "recommendations" before "explanation"
        (the decision right after the prompt, the explanation justifying it);
        False: the paper's order, the explanation first. The parser accepts
        either order, so this changes what is trained, not what is judged.
    """

    history_len: int = 10
    with_attributes: bool = True
    max_attributes: int = 3
    answer: str = "sid"
    answer_first: bool = False
    evidence: tuple[str, ...] = ()
    evidence_bins: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        # format.json gives lists; keep the config hashable and comparable.
        object.__setattr__(self, "evidence", tuple(str(n) for n in self.evidence))
        object.__setattr__(self, "evidence_bins", tuple(tuple(float(t) for t in b) for b in self.evidence_bins))
        if len(self.evidence) > MAX_EVIDENCE:
            raise ValueError(f"evidence: at most {MAX_EVIDENCE} features, got {len(self.evidence)}")
        if len(set(self.evidence)) != len(self.evidence):
            raise ValueError(f"evidence: repeated feature names {list(self.evidence)}")
        if len(self.evidence_bins) != len(self.evidence):
            raise ValueError(f"evidence_bins: {len(self.evidence_bins)} threshold lists for {len(self.evidence)} evidence features")
        for name, bins in zip(self.evidence, self.evidence_bins):
            if len(bins) > EVIDENCE_LEVELS - 1 or list(bins) != sorted(set(bins)):
                raise ValueError(f"evidence_bins of {name!r}: at most {EVIDENCE_LEVELS - 1} strictly ascending thresholds, got {list(bins)}")
        if self.answer not in ANSWER_FORMATS:
            raise ValueError(f"answer must be one of {ANSWER_FORMATS}, got {self.answer!r}")
        if self.history_len < 0:
            raise ValueError(f"history_len must be >= 0, got {self.history_len}")
        if self.max_attributes < 0:
            raise ValueError(f"max_attributes must be >= 0, got {self.max_attributes}")


class ItemText:
    """Item id -> its tokens, and semantic id text -> item id; built once from the items table.

    Args:
        items: the prepared items table, columns item_id (Int64), sid (List[Int64]
            of 4 codes, null for an item without a semantic id) and attributes
            (List[Int64], may be empty or null).

    Raises:
        ValueError: a semantic id that is not 4 non-negative codes, or two items
            sharing one (a generated id would then be ambiguous).
    """

    def __init__(self, items: pl.DataFrame) -> None:
        missing = {"item_id", "sid", "attributes"} - set(items.columns)
        if missing:
            raise ValueError(f"items table lacks columns {sorted(missing)}")
        self._sid: dict[int, tuple[str, ...]] = {}
        self._attrs: dict[int, tuple[str, ...]] = {}
        self._item_of: dict[tuple[int, ...], int] = {}
        for item, sid, attrs in zip(
            items["item_id"].to_list(), items["sid"].to_list(), items["attributes"].to_list()
        ):
            item = int(item)
            self._attrs[item] = tuple(attr_token(int(a)) for a in (attrs or ()))
            if sid is None:
                continue
            codes = tuple(int(c) for c in sid)
            if len(codes) != len(SID_LEVELS) or min(codes) < 0:
                raise ValueError(f"item {item}: semantic id {list(codes)} is not {len(SID_LEVELS)} codes >= 0")
            other = self._item_of.setdefault(codes, item)
            if other != item:
                raise ValueError(f"items {other} and {item} share semantic id {list(codes)}")
            self._sid[item] = tuple(sid_token(lvl, c) for lvl, c in zip(SID_LEVELS, codes))

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._sid

    def __len__(self) -> int:
        """Number of items with a semantic id."""
        return len(self._sid)

    def sid_tokens(self, item_id: int) -> list[str]:
        """The 4 semantic-id tokens of an item, e.g. ["<a_12>", "<b_5>", "<c_200>", "<d_3>"].

        Raises:
            KeyError: unknown item or item without a semantic id.
        """
        try:
            return list(self._sid[int(item_id)])
        except KeyError:
            raise KeyError(f"item {item_id} has no semantic id") from None

    def item_tokens(self, item_id: int, with_attributes: bool = True, max_attributes: int = 3) -> list[str]:
        """The item as written in a prompt: its sid tokens, then `( <attr_..> ... )`
        with at most `max_attributes` attributes (none, and no parentheses, when
        with_attributes is False or there is nothing to write)."""
        tokens = self.sid_tokens(item_id)
        attrs = self._attrs.get(int(item_id), ())[:max_attributes] if with_attributes else ()
        if attrs:
            tokens += ["(", *attrs, ")"]
        return tokens

    def item_of_sid(self, sid_text: str) -> int | None:
        """Item id of a semantic id written as its 4 tokens, whitespace-insensitive
        ("<a_1> <b_2> <c_3> <d_4>", " <a_1><b_2>  <c_3> <d_4> "); None when the text
        is not exactly one well-formed id or no item has it."""
        m = _SID_RE.fullmatch(sid_text.strip())
        # No item has a code of more than 18 digits (int64); int() of thousands of digits would raise.
        if m is None or any(len(g) > 18 for g in m.groups()):
            return None
        return self._item_of.get(tuple(int(g) for g in m.groups()))


def _check_distinct(candidates: Sequence[int]) -> None:
    if len(set(candidates)) != len(candidates):
        raise ValueError(f"candidates must be distinct item ids, got {list(candidates)}")


def evidence_levels(values: np.ndarray, bins: Sequence[Sequence[float]]) -> np.ndarray:
    """(K, F) int levels of (K, F) evidence values: column f's level is the number of
    thresholds bins[f] that the value reaches (0..len(bins[f]))."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] != len(bins):
        raise ValueError(f"evidence values of shape {values.shape}, expected (K, {len(bins)})")
    return np.stack([np.searchsorted(np.asarray(b, dtype=np.float64), values[:, f], side="right") for f, b in enumerate(bins)], axis=1)


def fit_evidence_bins(values: Sequence[np.ndarray], levels: int = EVIDENCE_LEVELS) -> tuple[tuple[float, ...], ...]:
    """Thresholds that cut each evidence feature into at most `levels` levels of
    about equal mass over `values` (the training lists).

    A value that holds at least 1/levels of the mass (a count feature's 0: "never
    bought together") gets a level of its own, so "none" and "a little" never
    share a token; the other values are cut at their quantiles with the
    thresholds left.

    Args:
        values: one (K, F) array per list.
    Returns:
        F tuples of ascending thresholds, for `FormatConfig.evidence_bins`.
    """
    if not 2 <= levels <= EVIDENCE_LEVELS:
        raise ValueError(f"levels must be in 2..{EVIDENCE_LEVELS}, got {levels}")
    if not values:
        raise ValueError("no evidence values to fit the levels on")
    x = np.concatenate([np.asarray(v, dtype=np.float64) for v in values])
    if not np.isfinite(x).all():
        raise ValueError("evidence values must be finite")
    return tuple(_feature_bins(x[:, f], levels) for f in range(x.shape[1]))


def _feature_bins(x: np.ndarray, levels: int) -> tuple[float, ...]:
    uniq, counts = np.unique(x, return_counts=True)
    points = uniq[counts >= len(x) / levels]
    # Each mass point p is isolated by the thresholds p and the next float above it.
    thresholds = {float(t) for p in points for t in (p, np.nextafter(p, np.inf))}
    budget = levels - 1 - len(thresholds)
    rest = x[~np.isin(x, points)]
    if budget < 0:  # too many mass points to isolate: plain quantiles
        thresholds, budget, rest = set(), levels - 1, x
    if budget > 0 and rest.size:
        thresholds |= {float(t) for t in np.quantile(rest, np.arange(1, budget + 1) / (budget + 1))}
    return tuple(sorted(thresholds))


def evidence_of(lists: pl.DataFrame, fmt: FormatConfig) -> list[list[list[int]] | None]:
    """Each row's (K, F) evidence levels (the `evidence` column), or None for every
    row when the format writes no evidence.

    Raises:
        ValueError: the format writes evidence but the lists lack the column or a row's levels.
    """
    if not fmt.evidence:
        return [None] * lists.height
    if "evidence" not in lists.columns:
        raise ValueError(
            f"the prompt format writes evidence {list(fmt.evidence)} but the lists have no 'evidence' column "
            "(read them with tasks.traces.load_lists, which joins data/traces/evidence)"
        )
    out = lists["evidence"].to_list()
    if missing := [i for i, e in enumerate(out) if e is None]:
        raise ValueError(f"{len(missing)} rows have no evidence levels (first: row {missing[0]})")
    return out


def build_prompt(
    history: Sequence[int],
    candidates: Sequence[int],
    items: ItemText,
    cfg: FormatConfig,
    evidence: Sequence[Sequence[int]] | None = None,
) -> str:
    """The prompt text: `<|user|> history : ITEM ... candidates : ITEM ... <|assistant|>`.

    Args:
        history: item ids, oldest first; only the last cfg.history_len are written.
        candidates: the K distinct candidate ids in the incoming (pre-rank) order.
        evidence: (K, F) levels of the cfg.evidence features (`evidence_levels`),
            required exactly when cfg.evidence is not empty.
    Raises:
        ValueError: repeated candidates; evidence missing, unexpected or of the wrong shape.
    """
    _check_distinct(candidates)
    if cfg.evidence and evidence is None:
        raise ValueError(f"the format writes evidence {list(cfg.evidence)}: pass each candidate's evidence levels")
    if evidence is not None:
        if not cfg.evidence:
            raise ValueError("evidence given but the format writes none (FormatConfig.evidence is empty)")
        if len(evidence) != len(candidates) or any(len(e) != len(cfg.evidence) for e in evidence):
            raise ValueError(f"evidence must give {len(cfg.evidence)} levels for each of the {len(candidates)} candidates")
    kept = list(history)[len(history) - cfg.history_len :] if cfg.history_len else []
    tokens = [USER, "history", ":"]
    for item in kept:
        tokens += items.item_tokens(item, cfg.with_attributes, cfg.max_attributes)
    tokens += ["candidates", ":"]
    for pos, item in enumerate(candidates, start=1):
        if cfg.answer == "index":
            tokens.append(pos_token(pos))
        if evidence is not None:
            tokens += [evidence_token(f, int(level)) for f, level in enumerate(evidence[pos - 1], start=1)]
        tokens += items.item_tokens(item, cfg.with_attributes, cfg.max_attributes)
    tokens.append(ASSISTANT)
    return " ".join(tokens)


def _check_word(word: str) -> None:
    # A word must be one whitespace-free token that keeps the JSON string valid
    # and cannot be mistaken for the end of the response.
    if not word or any(ch.isspace() for ch in word):
        raise ValueError(f"explanation token {word!r} is empty or contains whitespace")
    if '"' in word or "\\" in word or any(ord(ch) < 0x20 for ch in word):
        raise ValueError(f"explanation token {word!r} would need JSON escaping")
    if _SPECIAL_RE.search(word):
        raise ValueError(f"explanation token {word!r} contains a special token")


def build_response(
    explanation_tokens: Sequence[str],
    ranking: Sequence[int],
    items: ItemText,
    *,
    fmt: FormatConfig | None = None,
    candidates: Sequence[int] | None = None,
) -> str:
    """The response text, without the end token:
    `{ "explanation" : " w1 ... wn " , "recommendations" : [ " <a_..> <b_..> <c_..> <d_..> " , ... ] }`
    (answer "sid"), or with `" <pos_k> "` entries (answer "index": k is the
    item's 1-based position in `candidates`, the incoming order); with
    fmt.answer_first the two members swap places (`{ "recommendations" : [ ... ] , "explanation" : " ... " }`).

    The ranking is written as given (not checked to be a permutation), so invalid
    answers can be built on purpose; `parse_response` is the judge.

    Raises:
        ValueError: an explanation token that is empty, holds whitespace, `"`,
            a backslash or a control character, or contains a special token.
        KeyError: a ranked item without a semantic id.
        ValueError: answer "index" without candidates, or a ranked item not among them.
    """
    for word in explanation_tokens:
        _check_word(word)
    index = fmt is not None and fmt.answer == "index"
    if index:
        if candidates is None:
            raise ValueError("the index answer format needs the candidates (incoming order)")
        position = {int(c): k for k, c in enumerate(candidates, start=1)}
    explanation = [*EXPLANATION_OPENING, *explanation_tokens, '"']
    recommendations = [RECOMMENDATIONS_KEY, ":", "["]
    for i, item in enumerate(ranking):
        if i:
            recommendations.append(",")
        if index:
            if int(item) not in position:
                raise ValueError(f"ranked item {item} is not a candidate")
            recommendations += ['"', pos_token(position[int(item)]), '"']
        else:
            recommendations += ['"', *items.sid_tokens(item), '"']
    recommendations.append("]")
    first, second = (recommendations, explanation) if fmt is not None and fmt.answer_first else (explanation, recommendations)
    return " ".join(["{", *first, ",", *second, "}"])


def no_reasoning_prefix(fmt: FormatConfig) -> str:
    """The opening of a reasoning-first response whose explanation is empty:
    `{ "explanation" : " " ,`. A decoder forced to start with it writes the
    ranking with no reasoning before it (what the reasoning is worth).

    Raises:
        ValueError: fmt.answer_first (the ranking comes before the explanation, so
            blanking the explanation cannot change it).
    """
    if fmt.answer_first:
        raise ValueError("an answer-first response writes its ranking before the explanation: blanking the explanation changes no ranking")
    return " ".join([*REASONING_FIRST_OPENING, '"', ","])


def build_full_text(prompt: str, response: str) -> str:
    """prompt + response + end token, joined by single spaces: the training text."""
    return f"{prompt} {response} {EOS}"


@dataclass(frozen=True)
class ParsedResponse:
    """A judged response.

    valid_format: JSON object with exactly the keys "explanation" (a string) and
        "recommendations" (a list of strings, each exactly one well-formed 4-token
        semantic id, or one `<pos_k>` token in the index format; whitespace-insensitive).
    valid_permutation: valid_format and the ids are exactly a permutation of the
        K candidates.
    ranking: the parsed ranking (item ids) if valid_permutation, else the incoming
        order: the fallback, counted by callers through valid_permutation.
    explanation: the explanation in canonical spacing: semantic-id and attribute
        tokens set apart, whitespace runs collapsed to single spaces, stripped
        ("" when absent or not a string).
    error: "" when valid_permutation; else the first failed check, one of
        "not json", "not an object", "duplicate key", "missing key", "extra key",
        "not a string", "not a list", "bad id" (format errors), then "out of set",
        "too many", "duplicate", "missing candidate" (permutation errors).
    copies_incoming: valid_permutation and ranking == the incoming order.
    """

    valid_format: bool
    valid_permutation: bool
    ranking: list[int]
    explanation: str
    error: str
    copies_incoming: bool


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # json.loads silently keeps the last of two equal keys; a response that says
    # two things is not a well-formed answer.
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_response(
    text: str, candidates: Sequence[int], items: ItemText, *, fmt: FormatConfig | None = None
) -> ParsedResponse:
    """Judge a generated response against the K candidates (incoming order).

    fmt.answer says what a recommendation is: a semantic id ("sid", the default
    when fmt is None) or a position token ("index"; `<pos_k>` with k > K is
    "out of set").

    Tolerant to surrounding whitespace and to the end token: everything from the
    first `<|eos|>` on is dropped, since generation ends there (batched decoders
    leave padding after it). Whitespace inside the JSON strings is free (a BPE
    tokenizer's decode may glue "<a_1><b_2>"). Strict otherwise: anything else
    around the JSON object makes it "not json".

    Raises:
        ValueError: candidates are not distinct (a caller bug, not a bad answer).
    """
    incoming = [int(c) for c in candidates]
    _check_distinct(incoming)
    cut = text.find(EOS)
    body = (text if cut < 0 else text[:cut]).strip()

    def fail(error: str, *, valid_format: bool = False, explanation: str = "") -> ParsedResponse:
        return ParsedResponse(valid_format, False, list(incoming), explanation, error, False)

    try:
        obj = json.loads(body, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey:
        return fail("duplicate key")
    # ValueError besides JSONDecodeError: an integer of more than 4,300 digits
    # (Python's int parsing limit); RecursionError: deeply nested arrays.
    except (ValueError, RecursionError):
        return fail("not json")
    if not isinstance(obj, dict):
        return fail("not an object")
    raw_expl = obj.get("explanation")
    explanation = _canonical_explanation(raw_expl) if isinstance(raw_expl, str) else ""
    if "explanation" not in obj or "recommendations" not in obj:
        return fail("missing key", explanation=explanation)
    if len(obj) != 2:
        return fail("extra key", explanation=explanation)
    recs = obj["recommendations"]
    if not isinstance(raw_expl, str):
        return fail("not a string")
    if not isinstance(recs, list):
        return fail("not a list", explanation=explanation)
    if not all(isinstance(r, str) for r in recs):
        return fail("not a string", explanation=explanation)
    index = fmt is not None and fmt.answer == "index"
    id_re = POSITION_RE if index else _SID_RE
    matches = [id_re.fullmatch(r.strip()) for r in recs]
    if not all(matches):
        return fail("bad id", explanation=explanation)

    # Well-formed from here on; what remains is whether it is a permutation.
    if index:
        k = len(incoming)
        # A position of more digits than K has is out of set; int() of thousands of digits would raise.
        ids = [incoming[p - 1] if len(m.group(1)) <= len(str(k)) and 1 <= (p := int(m.group(1))) <= k else None for m in matches]  # type: ignore[union-attr]
    else:
        ids = [items.item_of_sid(r) for r in recs]
    allowed = set(incoming)
    if any(i is None or i not in allowed for i in ids):
        return fail("out of set", valid_format=True, explanation=explanation)
    # Order of the checks: with every id in the set, more than K entries must
    # repeat one, but "too many" names the cause better; K or fewer entries with
    # a repeat is "duplicate" (the parallel decoder's typical failure), and
    # without one, a short list is "missing candidate".
    if len(ids) > len(incoming):
        return fail("too many", valid_format=True, explanation=explanation)
    if len(set(ids)) != len(ids):
        return fail("duplicate", valid_format=True, explanation=explanation)
    if len(ids) < len(incoming):
        return fail("missing candidate", valid_format=True, explanation=explanation)
    ranking = [int(i) for i in ids if i is not None]
    return ParsedResponse(True, True, ranking, explanation, "", ranking == incoming)


def target_ranks(parsed: Sequence[ParsedResponse], targets: Sequence[int]) -> np.ndarray:
    """(n,) int64: 0-based rank of each target in its response's `ranking` (the
    fallback for an invalid answer), -1 when absent; per-example scores and
    bootstrap intervals start from it (`gr2model.task.metrics.per_example_gain`)."""
    if len(parsed) != len(targets):
        raise ValueError(f"{len(parsed)} responses but {len(targets)} targets")
    n = len(parsed)
    width = max((len(p.ranking) for p in parsed), default=0)
    # Pad ragged lists with -1, never an item id, so one (n, K) array serves.
    lists = np.full((n, width), -1, dtype=np.int64)
    for row, p in enumerate(parsed):
        lists[row, : len(p.ranking)] = p.ranking
    target_ids = np.asarray(targets, dtype=np.int64).reshape(n)
    # argmax has nothing to reduce over an empty axis (no responses, or K = 0).
    return rank_in_lists(lists, target_ids) if width and n else np.full(n, -1, dtype=np.int64)


def rerank_metrics(parsed: Sequence[ParsedResponse], targets: Sequence[int]) -> dict[str, float]:
    """Accuracy and validity of judged responses (the `metrics/evaluate.json` names).

    Accuracy uses each response's `ranking`, so invalid answers are scored by
    their fallback (the incoming order), as the protocol says.

    Args:
        parsed: n judged responses.
        targets: n target item ids.
    Returns:
        recall@1, recall@3, recall@5, ndcg@3, ndcg@5, valid_format_rate,
        valid_permutation_rate, copy_incoming_rate (shares in [0, 1]) and n;
        all zeros (n = 0) for no responses.
    """
    n = len(parsed)
    out = ranking_metrics(target_ranks(parsed, targets), (1, 3, 5), (3, 5))

    def rate(flags: list[bool]) -> float:
        return float(np.mean(flags)) if flags else 0.0

    out["valid_format_rate"] = rate([p.valid_format for p in parsed])
    out["valid_permutation_rate"] = rate([p.valid_permutation for p in parsed])
    out["copy_incoming_rate"] = rate([p.copies_incoming for p in parsed])
    out["n"] = n
    return {name: out[name] for name in RERANK_METRIC_NAMES}
