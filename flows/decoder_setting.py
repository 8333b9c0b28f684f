"""The decoder setting a registered re-ranker is served with: the one place a version names it.

Kept apart from `flows.registry` (which imports MLflow) so that what reads a version's
tags without talking to the registry (`gr2 serve-check`'s judgement, the gates' rules)
loads no MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, model_validator

from tasks.common import Count, Unit

DECODER_ARTIFACT = "decoder"  # decoder.json among a re-ranker version's artifacts
DECODER_TAG = "decoder."  # the prefix of the setting's tags on the version
# The `eval.checkpoint_md5` / `speed.checkpoint_md5` tag when dvc.lock could not tie the numbers to the
# version's checkpoint: the gates and `gr2 serve-check` refuse such numbers.
UNVERIFIED = "unverified"


class DecoderSetting(BaseModel):
    """How a registered re-ranker decodes when it is served: the one place a version names it.

    Written once at registration, as the `decoder` artifact (decoder.json, logged with the
    model: the served pyfunc decodes with it) and as `decoder.<field>` tags (`tags()`: what
    `flows.promote.record_evaluations` matches the metrics' rows against, so a version's
    accuracy and speed tags come from rows decoded exactly so). What is gated is what is served.

    decoder: "ar" (GR2's KV-cache loop), "diffusion" (the threshold decoder at `tau`, in
    sub-blocks of `sub_block_size` or whole blocks, with or without the approximate
    sub-block cache, the explanation at `explanation_tau` / `explanation_sub_block_size`
    (None: as the answer), under the answer grammar or not) or "spec" (GR2 verifying
    `draft_len` tokens drafted in `draft_steps` forwards, `draft_mode`).
    """

    model_config = {"extra": "forbid", "frozen": True}

    decoder: Literal["ar", "diffusion", "spec"]
    tau: Unit | None = None
    sub_block_size: Count | None = None
    sub_block_cache: bool = False
    explanation_tau: Unit | None = None
    explanation_sub_block_size: Count | None = None
    grammar: bool = False
    draft_len: Count | None = None
    draft_steps: Count | None = None
    draft_mode: Literal["block", "window"] | None = None

    @model_validator(mode="after")
    def _fields_of_its_decoder(self) -> DecoderSetting:
        diffusion = ("tau", "sub_block_size", "explanation_tau", "explanation_sub_block_size")
        spec = ("draft_len", "draft_steps", "draft_mode")
        if self.decoder == "diffusion" and self.tau is None:
            raise ValueError("a diffusion setting needs its commit threshold tau")
        if self.decoder == "spec" and any(getattr(self, f) is None for f in spec):
            raise ValueError(f"a speculative setting needs {list(spec)}")
        own = {"ar": (), "diffusion": diffusion, "spec": spec}[self.decoder]
        stray = [f for f in (*diffusion, *spec) if f not in own and getattr(self, f) is not None]
        if stray or (self.decoder != "diffusion" and self.sub_block_cache):
            raise ValueError(f"{stray or ['sub_block_cache']} do not apply to the {self.decoder} decoder")
        return self

    def tags(self) -> dict[str, str]:
        """`{"decoder.decoder": "diffusion", "decoder.tau": "0.9", "decoder.sub_block_size": "8", ...}`: every field."""
        return {DECODER_TAG + k: _tag_value(v) for k, v in self.model_dump().items()}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> DecoderSetting | None:
        """The setting a version's `decoder.*` tags record; None for a version registered before them."""
        found = {k[len(DECODER_TAG) :]: v for k, v in tags.items() if k.startswith(DECODER_TAG)}
        if "decoder" not in found:
            return None
        return cls.model_validate({k: _parse_tag_value(v) for k, v in found.items() if k in cls.model_fields})

    def label(self) -> str:
        """The setting in words, e.g. `diffusion: tau 0.9, sub-blocks of 8, explanation as the answer, no grammar`."""
        grammar = "under the answer grammar" if self.grammar else "no grammar"
        if self.decoder == "ar":
            return f"ar: GR2's KV-cache loop, {grammar}"
        if self.decoder == "spec":
            return f"spec: {self.draft_len} tokens drafted in {self.draft_steps} drafter forwards ({self.draft_mode}), GR2 verifying, {grammar}"
        parts = [f"tau {self.tau:g}", f"sub-blocks of {self.sub_block_size}" if self.sub_block_size else "whole blocks"]
        if self.sub_block_cache:
            parts.append("the approximate sub-block cache")
        if self.explanation_tau is None and self.explanation_sub_block_size is None:
            parts.append("explanation as the answer")
        else:
            parts.append(f"explanation at tau {self.explanation_tau if self.explanation_tau is not None else self.tau:g}"
                         + (f" in sub-blocks of {self.explanation_sub_block_size}" if self.explanation_sub_block_size else ""))  # fmt: skip
        parts.append(grammar)
        return "diffusion: " + ", ".join(parts)

    def matches(self, row: Mapping[str, Any]) -> bool:
        """Whether a metrics/speed.json row decoded with exactly this setting (an AR setting: our loop's row)."""
        if self.decoder == "ar":
            return row.get("decoder") == "ar" and not row.get("grammar") and not self.grammar
        if row.get("decoder") != self.decoder:
            return False
        if self.decoder == "spec":
            return (row.get("draft_len"), row.get("draft_steps"), row.get("draft_mode") or "block") == (self.draft_len, self.draft_steps, self.draft_mode)
        # Rows written before the `grammar` field: a grammar row is the one with a grammar_changed_rate.
        grammar = row.get("grammar", row.get("grammar_changed_rate") is not None)
        return (
            same_threshold(row.get("tau"), self.tau) and row.get("sub_block_size") == self.sub_block_size
            and bool(row.get("sub_block_cache")) == self.sub_block_cache
            and same_threshold(row.get("explanation_tau"), self.explanation_tau)
            and row.get("explanation_sub_block_size") == self.explanation_sub_block_size
            and bool(grammar) == self.grammar
        )  # fmt: skip


def _tag_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _parse_tag_value(text: str) -> Any:
    if text in ("none", "true", "false"):
        return {"none": None, "true": True, "false": False}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def same_threshold(a: Any, b: Any) -> bool:
    """Equal thresholds (None only equals None); floats compared as floats (0.9 from YAML and from a tag)."""
    if a is None or b is None:
        return a is b
    return abs(float(a) - float(b)) < 1e-9


def legacy_setting(is_diffusion: bool) -> DecoderSetting:
    """The setting of a version registered before settings were recorded: what its pyfunc decoded with
    (a diffusion checkpoint: whole blocks at tau 0.9, the request default; no grammar)."""
    return DecoderSetting(decoder="diffusion", tau=0.9) if is_diffusion else DecoderSetting(decoder="ar")


def evaluate_setting(section: Mapping[str, Any] | None) -> DecoderSetting:
    """The setting of evaluate's headline diffusion rows, from its params section (dvc.lock's or
    params.yaml's `evaluate`; absent keys take EvaluateConfig's defaults): `tau`, `sub_block_size`,
    `sub_block_cache`, the explanation as the answer, no grammar (the `+grammar` rows are extras)."""
    from tasks.evaluate import EvaluateConfig

    fields = EvaluateConfig.model_fields
    get = lambda key: (section or {}).get(key, fields[key].default)  # noqa: E731
    return DecoderSetting(decoder="diffusion", tau=get("tau"), sub_block_size=get("sub_block_size"), sub_block_cache=bool(get("sub_block_cache")))
