"""Promotion: move a model's `champion` alias to a version only through the gates in params.yaml.

Evidence lives on the registered versions as tags, so a decision can be read
(and re-checked) in the registry alone:

- registration (flows/registry.py) tags each version with its stage, git commit
  and dirty flag, the DVC hashes of its inputs and checkpoint, the Prefect flow
  run, and gives it the alias `challenger`;
- `record_evaluations` (run by the pipeline after its stages, and again by every
  promotion) adds the params hash of the stage, the evaluation metrics of that
  checkpoint (`eval.<split>.<metric>`, from metrics/evaluate.json) and, for a
  diffusion model, its decode speed (`speed.tau_<tau>.bs_<b>.<field>`, from
  metrics/speed.json), all from rows of the version's own decoder setting (its
  `decoder.*` tags, `flows.registry.DecoderSetting`: what it is served with).
  Numbers are only attached to a version when dvc.lock says they were measured
  on that version's checkpoint hash (or cannot say at all, which is then
  recorded as `unverified`, and refused by `judge`). The speculative `spec-gr2`
  gets its `spec-<drafter>` row (with `equal_to_gr2_rate`) and the bench's
  speculative rows of its drafting setting (`speed.tau_none.bs_<b>.<field>`).

`promote` judges the version against the current champion (gates: the numbers
measured on this checkpoint and with the served setting; no worse on the
configured metrics beyond a tolerance, the share of the model's own answers
(no grammar) that are a permutation of the candidates at least a floor, and for diffusion models a decode
speed-up floor (time per example) at a given tau and batch size; for `spec-gr2`
answers equal to GR2's on every evaluated example and a speed-up floor of its
own), then commits under a per-model lock: re-read the champion, refuse if it
changed since the judgement (compare-and-set), move the alias, read it back,
and record the decision and its numbers as tags on the version. MLflow has no
compare-and-set on aliases, so the lock (an fcntl lock file next to the SQLite
store) is what makes two racing promotions safe: the second one waits, sees the
champion moved, changes nothing and raises `PromotionConflict`.

    gr2 promote gr2               # judge the challenger; exit 1 when a gate fails
    gr2 promote diffusion-gr2 --version 3
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import BaseModel

from flows import dvc_stages
from flows.decoder_setting import UNVERIFIED
from flows.registry import (
    CHALLENGER, MODEL_STAGES, DecoderSetting, ModelStage, evaluate_setting, find_version, find_versions, version_description, version_setting,
)  # fmt: skip
from tasks.common import ParamsError, load_stage_config, read_params
from tasks.tracking import metric_key

log = logging.getLogger("flows.promote")

CHAMPION = "champion"
SECTION = "promote"  # params.yaml section (not a DVC stage: promotion changes the registry, not files)
EVALUATE_METRICS = "metrics/evaluate.json"
SPEED_METRICS = "metrics/speed.json"
SPEED_FIELDS = ("speedup", "seconds_per_example", "seconds_min", "seconds_max", "repeats", "tokens_per_s", "tokens_per_s_speedup",
                "nfe_per_token", "response_tokens", "recall@1", "valid_format_rate",
                "mean_accepted_length", "equal_to_gr2")  # the last two: speculative rows only  # fmt: skip


# ---------------------------------------------------------------------------
# Config


class _Config(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}


class SpeedGate(_Config):
    """Decode speed-up over the best AR decoder for the same weights (a row of metrics/speed.json): the AR
    decoder's time per example over the version's, on the bench row of the version's own decoder setting."""

    min_speedup: float = 2.0
    # Confidence threshold of the diffusion decoder the floor applies at; None for the
    # speculative re-ranker, whose rows have no threshold (GR2 decides every token).
    tau: float | None = 0.9
    batch_size: int = 1


class ModelGates(_Config):
    split: str = "test"
    metrics: list[str] = ["recall@1", "ndcg@3"]  # no worse than the champion beyond `tolerance`
    tolerance: float = 0.005  # absolute
    min_valid_permutation: float = 0.99
    speed: SpeedGate | None = None  # diffusion and speculative models only
    # Speculative models only: the least share of the split's evaluated examples whose answers
    # are GR2's token for token (evaluate's `spec-<drafter>` row, equal_to_gr2_rate). At 1.0,
    # the version's accuracy is GR2's on every example, which is what it promises.
    min_equal_to_gr2: float | None = None


class PromoteConfig(_Config):
    lock_timeout_s: float = 30.0  # how long a promotion waits for another one of the same model
    models: dict[str, ModelGates] = {}


def load_promote_config(root: Path) -> PromoteConfig:
    """The `promote:` section of `<root>/params.yaml` (errors name the field)."""
    path = root / "params.yaml"
    if SECTION not in read_params(path):
        return PromoteConfig()
    return load_stage_config(SECTION, PromoteConfig, path)


# ---------------------------------------------------------------------------
# Evidence tags


def eval_tag(split: str, metric: str) -> str:
    """`eval_tag("test", "recall@1") == "eval.test.recall_at_1"`."""
    return f"eval.{split}.{metric_key(metric)}"


def _tau_str(tau: float | None) -> str:
    return "none" if tau is None else f"{float(tau):g}"


def speed_tag(tau: float | None, batch_size: int, name: str) -> str:
    """`speed_tag(0.9, 1, "speedup") == "speed.tau_0.9.bs_1.speedup"`."""
    return f"speed.tau_{_tau_str(tau)}.bs_{int(batch_size)}.{metric_key(name)}"


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _measured_on(root: Path, metrics_file: str, checkpoint: str) -> str | None:
    """Which checkpoint hash the numbers in `metrics_file` were measured on, per dvc.lock.

    Returns the md5 the producing stage recorded for `checkpoint` among its deps,
    or None when dvc.lock cannot say (no stage outputs that file, or the checkpoint
    is not among that stage's deps).
    """
    import yaml

    lock_path = root / "dvc.lock"
    stages = (yaml.safe_load(lock_path.read_text()) or {}).get("stages", {}) if lock_path.exists() else {}
    for name, entry in stages.items():
        outs = {o["path"] for o in entry.get("outs", [])}
        if metrics_file in outs:
            deps = {d["path"]: d.get("md5") for d in entry.get("deps", [])}
            return deps.get(checkpoint)
    return None


def record_evaluations(root: Path, client: Any | None = None) -> list[dict[str, Any]]:
    """Tag every registered version found in this workspace with its params hash, eval metrics and speed.

    A version is found by its `checkpoint_md5` tag (the hash dvc.lock holds for
    the stage's checkpoint); the model name in metrics/evaluate.json and
    metrics/speed.json is the checkpoint folder's name (`checkpoints/gr2-sft` ->
    `gr2-sft`). A version keeps only numbers of its own decoder setting (its
    `decoder.*` tags, `flows.registry.DecoderSetting`): evaluate's headline row when
    evaluate decoded it so (dvc.lock's `evaluate` params: tau, sub-blocks, cache; no
    grammar), and the bench rows of exactly that setting, one per batch size. Numbers
    measured on another checkpoint hash, or at another setting, are not attached (the
    reason goes to `eval.not_attached` / `speed.not_attached`); tags of a section that is
    attached replace that section's old ones. Numbers dvc.lock cannot tie to the
    checkpoint are attached with checkpoint hash `unverified`, which `judge` refuses.
    Safe to run again: tags are overwritten with the same values.

    Returns one entry per version tagged: model, version, stage, and what was tagged.
    """
    from mlflow import MlflowClient

    client = client or MlflowClient()
    root = root.resolve()
    evaluation = _read_json(root / EVALUATE_METRICS) or {}
    speed_rows = (_read_json(root / SPEED_METRICS) or {}).get("rows", [])
    evaluated_with = (dvc_stages.lock_entry(root, "evaluate")["params"].get("params.yaml") or {}).get("evaluate")
    done = []
    for stage, spec in MODEL_STAGES.items():
        entry = dvc_stages.lock_entry(root, stage)
        md5 = entry["outs"].get(spec.checkpoint)
        if not md5:
            continue
        for mv in find_versions(client, spec.model_name, md5):
            tags, what = _version_evidence(root, spec, md5, mv, evaluation, speed_rows, evaluated_with)
            _write_tags(client, spec.model_name, mv, _params_tag(entry) | tags)
            if "eval" in what:  # the description gains the held-out numbers the version was judged on
                name = Path(spec.checkpoint).name
                setting = version_setting(mv.tags, spec)
                client.update_model_version(spec.model_name, str(mv.version), description=version_description(spec, root, md5, evaluation[name], setting))
            done.append({"model": spec.model_name, "version": str(mv.version), "stage": stage, "tagged": what})
            log.info("%s version %s (%s): tagged %s", spec.model_name, mv.version, stage, ", ".join(what) or "params hash only")
    done += _record_speculative(root, client, evaluation, speed_rows)
    return done


def _version_evidence(
    root: Path, spec: ModelStage, md5: str, mv: Any, evaluation: dict[str, Any], speed_rows: list[dict[str, Any]], evaluated_with: dict[str, Any] | None
) -> tuple[dict[str, str], list[str]]:
    """(tags, sections attached) of one version of a stage's checkpoint: its setting's eval and speed numbers."""
    name = Path(spec.checkpoint).name
    setting = version_setting(mv.tags, spec)
    tags: dict[str, str] = {}
    what: list[str] = []
    if setting is not None and DecoderSetting.from_tags(mv.tags) is None:
        tags |= setting.tags()  # registered before settings were recorded: what its pyfunc serves, said once
    if name in evaluation:
        measured = _measured_on(root, EVALUATE_METRICS, spec.checkpoint)
        rows_setting = _evaluated_setting(spec, evaluation[name], evaluated_with)
        if measured not in (None, md5):
            why = f"metrics/evaluate.json was measured on checkpoint {measured}, the version has {md5}"
            log.warning("%s: %s; eval tags not attached", spec.model_name, why)
            tags["eval.not_attached"] = why
        elif setting is not None and rows_setting != setting:
            why = f"evaluate decoded {name} with {rows_setting.label()}; the version serves {setting.label()}"
            log.warning("%s version %s: %s; eval tags not attached", spec.model_name, mv.version, why)
            tags["eval.not_attached"] = why
        else:
            tags |= _eval_tags(name, measured or UNVERIFIED, evaluation[name], rows_setting)
            what.append("eval")
    if setting is not None and setting.decoder == "diffusion":
        # AR rows are the reference every speed-up is relative to; the version's own rows are those of its setting.
        model_rows = [r for r in speed_rows if r.get("model") == name and r.get("decoder") == "diffusion"]
        rows = [r for r in model_rows if setting.matches(r)]
        measured = _measured_on(root, SPEED_METRICS, spec.checkpoint)
        why = ""
        if model_rows and not rows:
            why = f"metrics/speed.json has no row of {name} at the served setting ({setting.label()})"
        elif rows and measured not in (None, md5):
            why = f"metrics/speed.json was measured on checkpoint {measured}, the version has {md5}"
        elif rows:
            try:
                tags |= _speed_tags(measured or UNVERIFIED, rows, setting)
                what.append("speed")
            except ValueError as exc:
                why = str(exc)
        if why:
            log.warning("%s version %s: %s; speed tags not attached", spec.model_name, mv.version, why)
            tags["speed.not_attached"] = why
    return tags, what


def _evaluated_setting(spec: ModelStage, by_split: dict[str, Any], evaluated_with: dict[str, Any] | None) -> DecoderSetting:
    """How evaluate decoded a model's headline row: GR2's AR loop or evaluate's diffusion setting (its params
    in dvc.lock), under the grammar when the row has a grammar_changed_rate (rows from before headline rows went without)."""
    grammar = any(isinstance(m, dict) and m.get("grammar_changed_rate") is not None for m in by_split.values())
    base = evaluate_setting(evaluated_with) if spec.decoder == "diffusion" else DecoderSetting(decoder="ar")
    return base.model_copy(update={"grammar": grammar})


def _write_tags(client: Any, model: str, mv: Any, tags: dict[str, str]) -> None:
    """Set `tags` on the version; a section written anew (`eval.`, `speed.`) drops its old keys first,
    so no number of another setting or format outlives the section it came with."""
    fresh = {prefix for prefix in ("eval.", "speed.") if any(k.startswith(prefix) and not k.endswith(".not_attached") for k in tags)}
    for key in list(mv.tags):
        if key.split(".", 1)[0] + "." in fresh and key not in tags:
            client.delete_model_version_tag(model, str(mv.version), key)
    for key, value in tags.items():
        client.set_model_version_tag(model, str(mv.version), key, value)


def _params_tag(entry: dict[str, Any]) -> dict[str, str]:
    """`dvc.params.md5`: a hash of the params dvc.lock recorded for the stage ({} when none)."""
    if not entry["params"]:
        return {}
    return {"dvc.params.md5": hashlib.md5(json.dumps(entry["params"], sort_keys=True, default=str).encode()).hexdigest()}


def _eval_tags(name: str, measured_md5: str, by_split: dict[str, dict[str, Any]], setting: DecoderSetting) -> dict[str, str]:
    """The `eval.*` tags of the model `name` of metrics/evaluate.json, measured on checkpoint(s) `measured_md5`
    with decoder `setting` (`eval.setting`, its label; `eval.grammar`: whether the answers went through the grammar)."""
    tags = {"eval.model": name, "eval.checkpoint_md5": measured_md5, "eval.setting": setting.label(), "eval.grammar": "true" if setting.grammar else "false"}
    for split, metrics in by_split.items():
        for metric, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                tags[eval_tag(split, metric)] = repr(float(value))
    return tags


def _speed_tags(measured_md5: str, rows: list[dict[str, Any]], setting: DecoderSetting) -> dict[str, str]:
    """The `speed.*` tags of the metrics/speed.json rows of one decoder `setting` (one per batch size),
    measured on `measured_md5`; `speed.setting` says which setting. ValueError when two rows would write
    one tag (two rows of one setting and batch size: which one is the version's speed cannot be said)."""
    tags = {"speed.checkpoint_md5": measured_md5, "speed.setting": setting.label()}
    seen: set[tuple[str, int]] = set()
    for row in rows:
        if not setting.matches(row):
            raise ValueError(f"a metrics/speed.json row of another setting than {setting.label()}: {row}")
        tau, bs = row.get("tau"), int(row.get("batch_size", 1))
        if (_tau_str(tau), bs) in seen:
            raise ValueError(f"metrics/speed.json has two rows of {row.get('model')} at {setting.label()}, batch {bs}; which is its speed is ambiguous")
        seen.add((_tau_str(tau), bs))
        tags[speed_tag(tau, bs, "decoder")] = str(row.get("decoder"))
        for f in SPEED_FIELDS:
            if isinstance(row.get(f), (int, float)) and not isinstance(row.get(f), bool):
                tags[speed_tag(tau, bs, f)] = repr(float(row[f]))
    return tags


def _record_speculative(root: Path, client: Any, evaluation: dict[str, Any], speed_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`record_evaluations` for the speculative re-ranker: tag its version of the pair `evaluate` measured
    with the `spec-<drafter>` row (equal_to_gr2_rate among its metrics) and the bench's speculative rows.

    Both files are evaluate's outputs and the pair's hashes are evaluate's deps in
    dvc.lock, so the numbers are that pair's. Speed rows drafted with another
    draft length or step count than the version serves with are not attached.
    """
    from flows.registry import SPEC_MODEL, SPEC_STAGE, speculative_description, speculative_pairs
    from tasks.evaluate import SPEC_PREFIX

    done = []
    for pair in speculative_pairs(root):
        mv = find_version(client, SPEC_MODEL, pair.checkpoint_md5, pair.settings)
        if mv is None:
            continue
        name = SPEC_PREFIX + pair.drafter
        served = DecoderSetting.from_tags(mv.tags) or pair.setting  # a version before settings: its draft tags say it
        tags = _params_tag(dvc_stages.lock_entry(root, SPEC_STAGE)) | ({} if DecoderSetting.from_tags(mv.tags) else served.tags())
        what = []
        if name in evaluation:
            tags |= _eval_tags(name, pair.checkpoint_md5, evaluation[name], served)  # the pair's row drafts as the version (its identity)
            what.append("eval")
        drafted = [r for r in speed_rows if r.get("decoder") == "spec" and r.get("model") == pair.drafter]
        rows = [r for r in drafted if served.matches(r)]
        if drafted and not rows:
            measured = sorted({(r.get("draft_len"), r.get("draft_steps"), r.get("draft_mode") or "block") for r in drafted}, key=str)
            tags["speed.not_attached"] = f"{SPEC_MODEL} version {mv.version} serves {served.label()}, metrics/speed.json measured {measured}"
            log.warning("%s; speed tags not attached", tags["speed.not_attached"])
        elif rows:
            try:
                tags |= _speed_tags(pair.checkpoint_md5, rows, served)
                what.append("speed")
            except ValueError as exc:
                tags["speed.not_attached"] = str(exc)
                log.warning("%s version %s: %s; speed tags not attached", SPEC_MODEL, mv.version, exc)
        _write_tags(client, SPEC_MODEL, mv, tags)
        if "eval" in what:
            client.update_model_version(SPEC_MODEL, str(mv.version), description=speculative_description(mv.tags, evaluation[name]))
        done.append({"model": SPEC_MODEL, "version": str(mv.version), "stage": SPEC_STAGE, "tagged": what})
        log.info("%s version %s (%s): tagged %s", SPEC_MODEL, mv.version, SPEC_STAGE, ", ".join(what) or "params hash only")
    return done


# ---------------------------------------------------------------------------
# Gates


@dataclass
class GateResult:
    name: str
    passed: bool
    value: float | None  # the candidate's number
    reference: float | None  # the champion's number, when the gate compares with it
    threshold: float | None  # the number the candidate had to reach
    rule: str  # how the threshold is made, in words
    note: str = ""


@dataclass
class Decision:
    model: str
    version: str
    champion_before: str | None
    status: str  # "promoted" | "refused" | "already-champion"
    gates: list[GateResult] = field(default_factory=list)
    decided_at: str = ""

    @property
    def promoted(self) -> bool:
        return self.status == "promoted"

    @property
    def failed(self) -> list[GateResult]:
        return [g for g in self.gates if not g.passed]

    def summary(self) -> str:
        before = f"version {self.champion_before}" if self.champion_before else "no champion"
        if self.status == "already-champion":
            return f"{self.model} version {self.version} is already the champion; nothing to do"
        if self.promoted:
            return f"PROMOTED {self.model} version {self.version} to {CHAMPION} (before: {before})"
        reasons = "; ".join(_why(g) for g in self.failed)
        stays = f"champion stays version {self.champion_before}" if self.champion_before else "still no champion"
        return f"REFUSED {self.model} version {self.version} ({stays}): {reasons}"

    def table(self) -> str:
        """The gates as a fixed-width text table."""
        width = max([26, *(len(g.name) for g in self.gates)])
        head = f"{'gate':<{width}} {'challenger':>10} {'champion':>10} {'threshold':>10}  result  rule"
        lines = [head, "-" * len(head)]
        for g in self.gates:
            note = f" ({g.note})" if g.note else ""
            lines.append(f"{g.name:<{width}} {_fmt(g.value):>10} {_fmt(g.reference):>10} {_fmt(g.threshold):>10}  {'pass' if g.passed else 'FAIL':<6}  {g.rule}{note}")
        return "\n".join(lines)

    def markdown(self) -> str:
        rows = "\n".join(
            f"| {g.name} | {_fmt(g.value)} | {_fmt(g.reference)} | {_fmt(g.threshold)} | {'pass' if g.passed else '**FAIL**'} | {g.rule}{' (' + g.note + ')' if g.note else ''} |"
            for g in self.gates
        )
        return (
            f"# Promotion of `{self.model}` version {self.version}\n\n**{self.summary()}**\n\n"
            f"Decided {self.decided_at}; champion before: {self.champion_before or 'none'}.\n\n"
            "| gate | challenger | champion | threshold | result | rule |\n|---|---|---|---|---|---|\n" + rows + "\n"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "promoted": self.promoted, "summary": self.summary()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Decision:
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**fields, "gates": [GateResult(**g) for g in d.get("gates", [])]})


def _why(g: GateResult) -> str:
    """Why a gate failed: its number, the threshold, the rule and how far short it fell (or the missing number)."""
    if g.value is not None and g.threshold is not None and g.value < g.threshold:
        note = f"; {g.note}" if g.note else ""
        return f"{g.name} {_fmt(g.value)} < {_fmt(g.threshold)} (rule {g.rule}), short by {_fmt(g.threshold - g.value)}{note}"
    return f"{g.name}: {g.note}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _num(tags: dict[str, str], key: str) -> float | None:
    try:
        value = float(tags[key])
    except (KeyError, ValueError):
        return None
    return None if math.isnan(value) else value


def judge(tags: dict[str, str], champion_tags: dict[str, str] | None, gates: ModelGates) -> list[GateResult]:
    """The gates of a candidate (its version tags) against the champion's tags (None: no champion).

    Pure: reads numbers from the tags only. A number that is missing fails its
    gate with a note saying which tag is missing (and why it was not attached, when
    `record_evaluations` said). Before the numbers, two gates on where they come from
    (`_evidence_gates`): measured on this version's checkpoint (not `unverified`), and
    with the decoder setting the version serves.
    """
    out = _evidence_gates(tags, gates)
    unattached = f"; {tags['eval.not_attached']}" if tags.get("eval.not_attached") else ""
    for metric in gates.metrics:
        key = eval_tag(gates.split, metric)
        name = f"{metric} ({gates.split})"
        value = _num(tags, key)
        if value is None:
            out.append(GateResult(name, False, None, None, None, f">= champion - {gates.tolerance:g}", f"not evaluated: no tag {key}{unattached}"))
            continue
        if champion_tags is None:
            out.append(GateResult(name, True, value, None, None, "no champion yet", ""))
            continue
        ref = _num(champion_tags, key)
        if ref is None:
            out.append(GateResult(name, False, value, None, None, f">= champion - {gates.tolerance:g}", f"the champion has no tag {key}"))
            continue
        threshold = ref - gates.tolerance
        out.append(GateResult(name, value >= threshold - 1e-12, value, ref, threshold, f">= champion - {gates.tolerance:g}"))
    key = eval_tag(gates.split, "valid_permutation_rate")
    value = _num(tags, key)
    # Under the answer grammar every answer is valid by construction: such a rate says nothing of the model.
    grammar = tags.get("eval.grammar") == "true"
    if value is None:
        note = f"not evaluated: no tag {key}{unattached}"
    elif grammar:
        note = "measured under the answer grammar (valid by construction); the gate needs the model's own answers (evaluate's headline rows, without a grammar)"
    else:
        note = ""
    out.append(
        GateResult(
            f"valid_permutation_rate ({gates.split})",
            value is not None and value >= gates.min_valid_permutation and not grammar,
            value,
            _num(champion_tags or {}, key),
            gates.min_valid_permutation,
            f">= {gates.min_valid_permutation:g}, without a grammar",
            note,
        )
    )
    if gates.min_equal_to_gr2 is not None:
        key = eval_tag(gates.split, "equal_to_gr2_rate")
        value = _num(tags, key)
        n = _num(tags, eval_tag(gates.split, "n"))
        # The failing examples as a count too: "0.9990" of 2,076 hides that two answers differ.
        differ = f"{round((1 - value) * n)} of {int(n)} evaluated examples differ from GR2's answers" if value is not None and n else ""
        out.append(
            GateResult(
                f"equal_to_gr2_rate ({gates.split})",
                value is not None and value >= gates.min_equal_to_gr2 - 1e-12,
                value,
                _num(champion_tags or {}, key),
                gates.min_equal_to_gr2,
                f">= {gates.min_equal_to_gr2:g}",
                differ if value is not None else f"not evaluated: no tag {key} (evaluate's spec-<drafter> row)",
            )
        )
    if gates.speed is not None:
        s = gates.speed
        key = speed_tag(s.tau, s.batch_size, "speedup")
        value = _num(tags, key)
        at = f"tau {_tau_str(s.tau)}, batch {s.batch_size}" if s.tau is not None else f"batch {s.batch_size}"
        out.append(
            GateResult(
                f"speedup ({at})",
                value is not None and value >= s.min_speedup,
                value,
                _num(champion_tags or {}, key),
                s.min_speedup,
                f">= {s.min_speedup:g}x over AR",
                "" if value is not None else f"not measured: no tag {key} (metrics/speed.json row for this model at {at}"
                + (f", {tags['decoder.decoder']} setting served" if "decoder.decoder" in tags else "")
                + (f"; {tags['speed.not_attached']})" if tags.get("speed.not_attached") else ")"),
            )
        )
    return out


def _evidence_gates(tags: dict[str, str], gates: ModelGates) -> list[GateResult]:
    """Where the numbers come from: `evidence (dvc.lock)`, the eval (and speed) numbers measured on this
    version's checkpoint hash, never `unverified`; `decoder setting`, measured with the setting the
    version serves (its `decoder.*` tags, against the sections' `eval.setting` / `speed.setting`)."""
    sections = [("eval", EVALUATE_METRICS)] + ([("speed", SPEED_METRICS)] if gates.speed is not None else [])
    present = [(section, file) for section, file in sections if f"{section}.checkpoint_md5" in tags]
    version_md5 = tags.get("checkpoint_md5")
    problems = []
    for section, file in present:
        measured = tags[f"{section}.checkpoint_md5"]
        if measured == UNVERIFIED:
            problems.append(
                f"the {section} numbers are unverified: dvc.lock does not tie {file} to this version's checkpoint "
                "(no stage that wrote it lists the checkpoint among its deps), so they may be another model's"
            )
        elif measured != version_md5:
            problems.append(f"the {section} numbers were measured on checkpoint {measured}, the version is {version_md5 or 'untagged'}")
    out = [GateResult("evidence (dvc.lock)", not problems, None, None, None, "measured on this checkpoint", "; ".join(problems))]
    served = DecoderSetting.from_tags(tags)
    if served is None:
        out.append(GateResult("decoder setting", False, None, None, None, "measured as served",
                              "the version records no decoder setting (decoder.* tags), so what it serves cannot be matched with what was measured"))  # fmt: skip
        return out
    problems = []
    for section, _ in present:
        measured_with = tags.get(f"{section}.setting")
        if measured_with is None:
            problems.append(f"the {section} numbers do not say which decoder setting they measured (tagged before settings were recorded)")
        elif measured_with != served.label():
            problems.append(f"the {section} numbers were measured with {measured_with}; the version serves {served.label()}")
    out.append(GateResult("decoder setting", not problems, None, None, None, "measured as served", "; ".join(problems) or served.label()))
    return out


# ---------------------------------------------------------------------------
# Committing a decision safely


class PromotionError(RuntimeError):
    """A promotion that cannot be judged (no such model or version, no gates configured)."""


class PromotionConflict(PromotionError):
    """Another promotion changed the champion between this one's judgement and its commit."""


class PromotionBusy(PromotionError):
    """Another promotion of the same model held the lock for longer than the timeout."""


def lock_path(model: str, root: Path, tracking_uri: str | None = None) -> Path:
    """The lock file of a model's promotions: next to the SQLite store, else under `<root>/.gr2/`.

    Against an MLflow server on another machine the file lock only serialises
    promotions started from this file system (set GR2_PROMOTE_LOCK_DIR to a
    shared folder); the compare-and-set and read-back checks still apply.
    """
    if env := os.environ.get("GR2_PROMOTE_LOCK_DIR"):
        folder = Path(env)
    elif tracking_uri and tracking_uri.startswith("sqlite:///"):
        folder = Path(tracking_uri[len("sqlite:///") :]).resolve().parent
    else:
        folder = root / ".gr2"
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    return folder / f".promote-{slug}.lock"


@contextmanager
def promotion_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive fcntl lock on `path`, waited for up to `timeout_s` seconds.

    flock locks belong to the open file description, so two threads of one
    process exclude each other as two processes do; the kernel drops the lock
    when the holder dies, so a crashed promotion never leaves it stuck.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                    raise PromotionBusy(f"another promotion holds {path} ({holder}) for more than {timeout_s:g} s; try again later") from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {datetime.now(timezone.utc).isoformat(timespec='seconds')}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _champion(client: Any, model: str) -> str | None:
    version = client.get_registered_model(model).aliases.get(CHAMPION)
    return None if version is None else str(version)


def _decision_tags(decision: Decision, flow_run_id: str | None) -> dict[str, str]:
    return {
        "promotion.decision": decision.status,
        "promotion.decided_at": decision.decided_at,
        "promotion.champion_before": decision.champion_before or "none",
        "promotion.failed_gates": ",".join(g.name for g in decision.failed),
        "promotion.gates": json.dumps([asdict(g) for g in decision.gates])[:4900],
        "promotion.summary": decision.summary()[:4900],
        "promotion.prefect_flow_run_id": flow_run_id or "",
    }


def decide(client: Any, model: str, version: str | None, gates: ModelGates) -> Decision:
    """Judge a version (default: the `challenger`) against the current champion; changes nothing."""
    from mlflow.exceptions import MlflowException

    try:
        registered = client.get_registered_model(model)
    except MlflowException as exc:
        raise PromotionError(f"no registered model '{model}' in {client.tracking_uri}") from exc
    if version is None:
        version = registered.aliases.get(CHALLENGER)
        if version is None:
            raise PromotionError(f"{model} has no version with alias '{CHALLENGER}'; pass --version")
    version = str(version)
    try:
        mv = client.get_model_version(model, version)
    except MlflowException as exc:
        raise PromotionError(f"{model} has no version {version}") from exc
    champion = registered.aliases.get(CHAMPION)
    champion = None if champion is None else str(champion)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if champion == version:
        return Decision(model, version, champion, "already-champion", [], now)
    champion_tags = dict(client.get_model_version(model, champion).tags) if champion else None
    results = judge(dict(mv.tags), champion_tags, gates)
    status = "promoted" if all(g.passed for g in results) else "refused"
    return Decision(model, version, champion, status, results, now)


def commit(client: Any, decision: Decision, lock: Path, timeout_s: float, flow_run_id: str | None = None) -> Decision:
    """Record the decision on the version and, if promoted, move `champion`, all under the lock.

    Compare-and-set: when the champion is no longer the one the decision was
    judged against, nothing is written and PromotionConflict is raised. After
    moving the alias it is read back; if anything after the move fails, the
    alias is put back where it was, so the registry never holds half a promotion.
    """
    if decision.status == "already-champion":
        return decision
    model, version = decision.model, decision.version
    with promotion_lock(lock, timeout_s):
        current = _champion(client, model)
        if current != decision.champion_before:
            raise PromotionConflict(
                f"{model}: the champion changed from {decision.champion_before or 'none'} to {current or 'none'} "
                f"while version {version} was being judged (another promotion won the race); nothing was changed. "
                f"Run the promotion again to judge version {version} against the new champion."
            )
        tags = _decision_tags(decision, flow_run_id)
        if not decision.promoted:
            for key, value in tags.items():
                client.set_model_version_tag(model, version, key, value)
            return decision
        client.set_registered_model_alias(model, CHAMPION, version)
        try:
            now = _champion(client, model)
            if now != version:
                raise PromotionConflict(f"{model}: {CHAMPION} reads {now} right after setting it to {version}; another writer bypassed the lock")
            for key, value in tags.items():
                client.set_model_version_tag(model, version, key, value)
            if decision.champion_before:
                client.set_model_version_tag(model, decision.champion_before, "promotion.replaced_by", version)
        except BaseException:
            # Put the registry back as it was before this promotion.
            if decision.champion_before:
                client.set_registered_model_alias(model, CHAMPION, decision.champion_before)
            else:
                client.delete_registered_model_alias(model, CHAMPION)
            raise
    log.info("%s", decision.summary())
    return decision


def promote(
    model: str,
    version: str | None = None,
    root: Path = Path("."),
    config: PromoteConfig | None = None,
    client: Any | None = None,
    flow_run_id: str | None = None,
    refresh: bool = True,
) -> Decision:
    """Judge `model` `version` (default: its challenger) through its gates and commit the decision.

    With `refresh`, first re-reads this workspace's metrics files into the
    versions' tags (`record_evaluations`), so numbers measured since the last
    pipeline run count. Raises PromotionError (and its subclasses
    PromotionConflict, PromotionBusy) when nothing could be decided or committed.
    """
    from mlflow import MlflowClient

    root = root.resolve()
    client = client or MlflowClient()
    try:
        config = config or load_promote_config(root)
    except ParamsError as exc:
        raise PromotionError(str(exc)) from exc
    if model not in config.models:
        raise PromotionError(f"no promotion gates for '{model}' in {root / 'params.yaml'} (promote.models has {sorted(config.models)})")
    if refresh and (root / "dvc.lock").exists():
        record_evaluations(root, client)
    decision = decide(client, model, version, config.models[model])
    return commit(client, decision, lock_path(model, root, client.tracking_uri), config.lock_timeout_s, flow_run_id)


# ---------------------------------------------------------------------------
# Prefect: the flow, and the task the pipeline runs after its stages

@task(name="record-evaluations", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def record_evaluations_task(root: str) -> list[dict[str, Any]]:
    """Tag the registered versions of this workspace with their params hash, eval metrics and speed."""
    done = record_evaluations(Path(root))
    for d in done:
        get_run_logger().info("%s version %s (%s): %s", d["model"], d["version"], d["stage"], ", ".join(d["tagged"]) or "params hash")
    return done


@flow(name="gr2-promote")
def promote_flow(model: str, version: str | None = None, root: str = ".") -> dict[str, Any]:
    """Judge and commit a promotion; the gate table becomes a markdown artifact `gr2-promote-<model>`."""
    from tasks.tracking import configure

    rootp = Path(root).resolve()
    configure(rootp)
    decision = promote(model, version, rootp, flow_run_id=str(flow_run.get_id() or ""))
    get_run_logger().info("%s\n%s", decision.summary(), decision.table())
    key = "gr2-promote-" + "".join(c if c.isalnum() else "-" for c in model.lower())
    create_markdown_artifact(decision.markdown(), key=key, description=decision.summary()[:500])
    return decision.to_dict()
