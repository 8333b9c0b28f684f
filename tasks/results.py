"""`gr2 results`: the results page, generated from a workspace's metrics so that no number is typed twice.

Reads, from a workspace (the project folder or a `gr2 workspace` copy):

- `metrics/evaluate.json` (required): `{model: {split: {metric: value}}}`, with
  `<metric>_ci95` = `[lo, hi]` and `<metric>_vs_prerank` / `<metric>_vs_gr2` =
  `{"diff": d, "ci95": [lo, hi]}` for R@1 and NDCG@3;
- `metrics/speed.json` (optional): the decode-speed benchmark's rows;
- `metrics/<stage>.json` (optional): each stage's `seconds`;
- `dvc.lock` (optional): the md5 of every stage output, and `git rev-parse HEAD`
  of the workspace: what the numbers came from.

and writes `docs/results.md` (the ablation table per split, the diffusion
ladder against GR2, the speed at the parity point, the stage times, the stamp).
The same call rewrites the README's results block, the lines between
`RESULTS_BEGIN` and `RESULTS_END`, with the headline table of that page.

Only the standard library and yaml at import time: the page is a view of files on
disk and needs no model code (the parity rule comes from `tasks.report`, imported
where the speed section needs it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "RESULTS_BEGIN",
    "RESULTS_END",
    "ResultsError",
    "Stamp",
    "WorkspaceResults",
    "ablation_table",
    "diffusion_ladder",
    "headline_block",
    "load_results",
    "model_order",
    "read_evaluate",
    "file_md5",
    "read_stamp",
    "render_results",
    "replace_block",
    "speed_summary",
    "stage_times",
    "write_results",
]

RESULTS_BEGIN = "<!-- results:begin -->"
RESULTS_END = "<!-- results:end -->"
EVALUATE = Path("metrics/evaluate.json")
SPEED = Path("metrics/speed.json")
METRICS_DIR = Path("metrics")
HEADLINE_SPLIT = "test"  # the promotion gates judge on test; so does the README's one table

# Rows in the order a reader compares them: baselines, the AR chain, then each diffusion stage.
# `<model>+grammar` (the same model decoded under the answer grammar) follows its model; a model
# not named here follows in the file's order, so a new row never disappears from the page.
KNOWN_MODELS: tuple[str, ...] = (
    "prerank", "teacher", "random", "gr2-sft", "gr2", "gr2-no-reasoning",
    "dgr2-naive", "dgr2-cft", "dgr2-opd", "dgr2",
)  # fmt: skip
LADDER: tuple[str, ...] = ("dgr2-naive", "dgr2-cft", "dgr2-opd", "dgr2")  # GR2 -> Diffusion-GR2, one stage per row
GRAMMAR_SUFFIX = "+grammar"
SPEC_PREFIX = "spec-"


class ResultsError(ValueError):
    """A results input is missing or not in the documented shape; the message names the file."""


@dataclass(frozen=True)
class Stamp:
    """What the numbers came from: the workspace's git commit and the md5 of each stage output in dvc.lock."""

    commit: str | None  # None: no git, or no commit yet
    dirty: bool  # tracked files other than dvc.lock differ from the commit
    outs: dict[str, dict[str, str]] = field(default_factory=dict)  # stage -> {output path: md5}
    evaluate_matches_lock: bool | None = None  # metrics/evaluate.json's md5 equals dvc.lock's; None: not recorded


@dataclass
class WorkspaceResults:
    """Everything the page shows, read from one workspace."""

    root: Path
    evaluate: dict[str, dict[str, dict[str, Any]]]  # {model: {split: {metric: value}}}
    speed: dict[str, Any] | None  # metrics/speed.json ({"rows": [...], ...}); None when absent
    seconds: dict[str, float | None]  # stage -> `seconds` of metrics/<stage>.json, in dvc.yaml's order
    stamp: Stamp


# --- reading ---------------------------------------------------------------------------------


def read_evaluate(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """metrics/evaluate.json as `{model: {split: {metric: value}}}`.

    Raises ResultsError naming `path` when it is missing, not JSON, or not that shape."""
    if not path.is_file():
        raise ResultsError(f"{path}: not found; run the evaluate stage first (`gr2 run`), or pass the workspace with --root")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or not data:
        raise ResultsError(f"{path}: expected a non-empty object {{model: {{split: {{metric: value}}}}}}, found {type(data).__name__}")
    for model, splits in data.items():
        if not isinstance(splits, dict) or not all(isinstance(m, dict) for m in splits.values()):
            raise ResultsError(f"{path}: model {model!r}: expected {{split: {{metric: value}}}}")
    return data


def _read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object, or None when the optional file is missing or unreadable (its section says so)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stage_names(root: Path) -> list[str]:
    """The stages in dvc.yaml's order (the pipeline's one written order); [] without dvc.yaml."""
    try:
        stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError):
        return []
    return list(stages)


def stage_times(root: Path) -> dict[str, float | None]:
    """stage -> the `seconds` of its metrics/<stage>.json (None when missing), in dvc.yaml's order."""
    out: dict[str, float | None] = {}
    for stage in _stage_names(root):
        secs = (_read_json_object(root / METRICS_DIR / f"{stage}.json") or {}).get("seconds")
        out[stage] = float(secs) if _number(secs) is not None else None
    return out


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def file_md5(path: Path) -> str:
    """The md5 of a file's bytes, as dvc.lock records an output's (read in chunks: checkpoints are large)."""
    h = hashlib.md5()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_stamp(root: Path) -> Stamp:
    """The workspace's commit (None without git) and dvc.lock's output md5s (empty without a readable dvc.lock)."""
    head = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if head else None
    # dvc.lock is rewritten by every run, so it does not make the source dirty (as the registry's lineage tags).
    dirty = bool(status) and any(line[3:].strip() != "dvc.lock" for line in status.splitlines() if line.strip())
    outs: dict[str, dict[str, str]] = {}
    try:
        lock = yaml.safe_load((root / "dvc.lock").read_text()) or {}
    except (OSError, yaml.YAMLError):
        lock = {}
    for stage, entry in (lock.get("stages") or {}).items():
        stage_outs = {o["path"]: str(o.get("md5", "")) for o in (entry or {}).get("outs", []) if isinstance(o, dict) and "path" in o}
        if stage_outs:
            outs[stage] = stage_outs
    recorded = outs.get("evaluate", {}).get(str(EVALUATE))
    matches = None
    if recorded and (root / EVALUATE).is_file():
        matches = file_md5(root / EVALUATE) == recorded
    return Stamp(commit=head.strip() if head else None, dirty=dirty, outs=outs, evaluate_matches_lock=matches)


def load_results(root: Path) -> WorkspaceResults:
    """Read a workspace's results; ResultsError (naming the file) when metrics/evaluate.json is missing or malformed."""
    root = Path(root)
    return WorkspaceResults(
        root=root,
        evaluate=read_evaluate(root / EVALUATE),
        speed=_read_json_object(root / SPEED),
        seconds=stage_times(root),
        stamp=read_stamp(root),
    )


# --- formatting ------------------------------------------------------------------------------


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
        return None
    return float(x)


def _fmt(x: Any, digits: int = 4) -> str:
    v = _number(x)
    return "-" if v is None else f"{v:.{digits}f}"


def _interval(ci: Any, signed: bool) -> str:
    if not isinstance(ci, Sequence) or len(ci) != 2 or any(_number(c) is None for c in ci):
        return ""
    f = (lambda c: f"{float(c):+.4f}") if signed else (lambda c: f"{float(c):.4f}")
    return f" [{f(ci[0])}, {f(ci[1])}]"


def _with_ci(m: Mapping[str, Any], metric: str) -> str:
    """`0.3372 [0.3170, 0.3574]` from `metric` and `metric_ci95`; `-` when absent."""
    value = _fmt(m.get(metric))
    return value if value == "-" else value + _interval(m.get(f"{metric}_ci95"), signed=False)


def _diff(m: Mapping[str, Any], key: str) -> str:
    """`+0.0149 [+0.0058, +0.0246]` from a `{"diff", "ci95"}` entry; `-` when absent."""
    d = m.get(key)
    if not isinstance(d, Mapping) or _number(d.get("diff")) is None:
        return "-"
    return f"{float(d['diff']):+.4f}" + _interval(d.get("ci95"), signed=True)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def model_order(models: Sequence[str]) -> list[str]:
    """The page's row order: KNOWN_MODELS first (each followed by its `+grammar` row), `spec-*`, then the rest."""
    present = list(models)
    order: list[str] = []
    for name in KNOWN_MODELS:
        for candidate in (name, name + GRAMMAR_SUFFIX):
            if candidate in present:
                order.append(candidate)
    order += [m for m in present if m.startswith(SPEC_PREFIX) and m not in order]
    order += [m for m in present if m not in order]
    return order


# --- the tables ------------------------------------------------------------------------------

ABLATION_HEADER = ("model", "n", "R@1", "NDCG@3", "R@1 - prerank", "NDCG@3 - prerank", "valid permutations", "copies the incoming order")


def ablation_rows(evaluate: Mapping[str, Mapping[str, Mapping[str, Any]]], split: str) -> list[list[str]]:
    """One row per model that has `split`: n, R@1 and NDCG@3 (with intervals), their paired differences
    to prerank (with intervals), valid-permutation and copy rates. Shape: [models][len(ABLATION_HEADER)]."""
    rows = []
    for model in model_order(list(evaluate)):
        m = evaluate[model].get(split)
        if m is None:
            continue
        n = _number(m.get("n"))
        rows.append([
            f"`{model}`", "-" if n is None else f"{int(n):,}", _with_ci(m, "recall@1"), _with_ci(m, "ndcg@3"),
            _diff(m, "recall@1_vs_prerank"), _diff(m, "ndcg@3_vs_prerank"),
            _fmt(m.get("valid_permutation_rate")), _fmt(m.get("copy_incoming_rate")),
        ])  # fmt: skip
    return rows


def ablation_table(evaluate: Mapping[str, Mapping[str, Mapping[str, Any]]], split: str) -> str:
    """The ablation table of one split as markdown ('' when no model has that split)."""
    rows = ablation_rows(evaluate, split)
    return _table(ABLATION_HEADER, rows) if rows else ""


LADDER_HEADER = (
    "model", "R@1", "R@1 - gr2", "NDCG@3 - gr2", "R@1 - prerank", "NDCG@3 - prerank", "top-1 as GR2's", "valid permutations",
    "tokens per forward", "grammar changed",
)  # fmt: skip


def diffusion_ladder(evaluate: Mapping[str, Mapping[str, Mapping[str, Any]]], split: str) -> str:
    """GR2 and each diffusion stage (with its `+grammar` row) against GR2: paired differences of R@1 and
    NDCG@3, the share of first items equal to GR2's, validity; '' when no diffusion row has `split`."""
    names = [m for m in model_order(list(evaluate)) if m.removesuffix(GRAMMAR_SUFFIX) in LADDER and split in evaluate[m]]
    if not names:
        return ""
    rows = []
    for model in (["gr2"] if "gr2" in evaluate and split in evaluate["gr2"] else []) + names:
        m = evaluate[model][split]
        rows.append([
            f"`{model}`", _with_ci(m, "recall@1"), _diff(m, "recall@1_vs_gr2"), _diff(m, "ndcg@3_vs_gr2"),
            _diff(m, "recall@1_vs_prerank"), _diff(m, "ndcg@3_vs_prerank"), _fmt(m.get("top1_agreement_vs_gr2")),
            _fmt(m.get("valid_permutation_rate")), _fmt(m.get("tokens_per_forward"), 2), _fmt(m.get("grammar_changed_rate")),
        ])  # fmt: skip
    return _table(LADDER_HEADER, rows)


def speed_summary(speed: Mapping[str, Any] | None) -> str:
    """The parity point at batch 1 (the fastest diffusion setting as accurate and valid as AR, the
    promotion gates' bar) and the speculative rows at batch 1, as markdown; a line saying why when absent."""
    if not speed or not isinstance(speed.get("rows"), list):
        return "No `metrics/speed.json` in this workspace (the benchmark runs at the end of `evaluate`, or `gr2 bench decode`)."
    from tasks.report import PARITY_MIN_VALID_FORMAT, PARITY_R1_TOLERANCE, ar_reference, parity_point, setting_label  # the one parity rule

    rows = speed["rows"]
    ar = ar_reference(rows, 1)
    where = f"the first {speed.get('examples', '?')} test prompts, device {speed.get('device', '?')}, threads {speed.get('threads', '?')}"
    if ar is None:
        return f"`metrics/speed.json` ({where}) has no AR row at batch 1, so no speed-up can be stated."
    lines = [
        f"Batch 1, {where}; speed-ups over {'our AR loop' if ar.get('decoder') == 'ar' else 'HF generate'} "
        f"({_fmt(ar.get('tokens_per_s'), 0)} tokens/s) measured in the same run.",
        "",
    ]
    p = parity_point(rows, 1)
    if p is None:
        n_diff = sum(1 for r in rows if r.get("batch_size") == 1 and r.get("decoder") == "diffusion")
        lines.append(
            f"Parity point: none. No diffusion setting at batch 1 (of {n_diff}) is within {PARITY_R1_TOLERANCE} of AR's R@1 "
            f"with a valid-format rate of at least {PARITY_MIN_VALID_FORMAT}."
        )
    else:
        if _number(p.get("every_example_recall@1_vs_gr2")) is not None:  # judged on evaluate's every example
            judged = (
                f"R@1 {float(p['every_example_recall@1_vs_gr2']):+.4f} against GR2 and valid format "
                f"{_fmt(p.get('every_example_valid_format_rate'))} on every evaluated example"
            )
        else:
            judged = f"R@1 {_fmt(p.get('recall@1'))} (AR {_fmt(ar.get('recall@1'))}) and valid format {_fmt(p.get('valid_format_rate'))} on the bench's prompts"
        lines.append(
            f"Parity point: `{p.get('model')}`, {setting_label(p)}: **{float(p['speedup']):.2f}x**, "
            f"{_fmt(p.get('tokens_per_forward'), 2)} tokens per forward; {judged}."
        )
    spec = [r for r in rows if r.get("batch_size") == 1 and r.get("decoder") == "spec"]
    if spec:
        lines += ["", _table(
            ("speculative drafter", "draft", "x AR", "accepted per round", "equal to GR2"),
            [[f"`{r.get('model')}`", f"{r.get('draft_mode') or '-'} {r.get('draft_len') or ''}".strip(), f"{_fmt(r.get('speedup'), 2)}x",
              _fmt(r.get("mean_accepted_length"), 2), _fmt(r.get("equal_to_gr2"), 3)] for r in spec],
        )]  # fmt: skip
    return "\n".join(lines)


def _stamp_line(stamp: Stamp) -> str:
    commit = "no git commit" if stamp.commit is None else f"commit `{stamp.commit[:12]}`" + (" (uncommitted changes)" if stamp.dirty else "")
    ev = stamp.outs.get("evaluate", {}).get(str(EVALUATE))
    lock = f"`metrics/evaluate.json` md5 `{ev}` in dvc.lock" if ev else "no dvc.lock record of `metrics/evaluate.json`"
    if stamp.evaluate_matches_lock is False:
        lock += " (the file on disk differs: changed after the stage ran)"
    return f"{commit}; {lock}"


def render_results(res: WorkspaceResults, workspace_label: str | None = None) -> str:
    """docs/results.md as one markdown string."""
    label = workspace_label or str(res.root)
    splits = [s for s in (HEADLINE_SPLIT, "valid") if any(s in v for v in res.evaluate.values())]
    splits += sorted({s for v in res.evaluate.values() for s in v} - set(splits))
    out = [
        "# Results",
        "",
        f"Generated by `gr2 results` from `{label}`: {_stamp_line(res.stamp)}. Do not edit by hand;",
        "rerun the command after `gr2 run`. How each number is measured: [design](design.md) and",
        "[decoding](decoding.md); how the defaults were chosen: [the experiment log](LOG.md).",
        "",
        "R@1 and NDCG@3 with 95% bootstrap intervals over the split's re-ranking examples;",
        "differences are paired (same resamples). An invalid answer falls back to the incoming",
        "order and is counted. A `+grammar` row is the same model decoded under the answer grammar.",
    ]
    for split in splits:
        out += ["", f"## Ablation, {split}", "", ablation_table(res.evaluate, split)]
        ladder = diffusion_ladder(res.evaluate, split)
        if ladder:
            out += ["", f"### From GR2 to Diffusion-GR2, {split} (paired against `gr2`)", "", ladder]
    out += ["", "## Decode speed", "", speed_summary(res.speed)]
    out += ["", "## Stage times", "", "The `seconds` of each `metrics/<stage>.json` (the stage's own work, without process start).", ""]
    times = [[f"`{s}`", "not recorded" if v is None else f"{v:,.1f}"] for s, v in res.seconds.items()]
    out.append(_table(("stage", "seconds"), times) if times else "No dvc.yaml in this workspace.")
    out += ["", "## Where the numbers came from", "", _stamp_line(res.stamp) + ".", ""]
    if res.stamp.outs:
        out.append(_table(("stage", "output", "md5 (dvc.lock)"), [[f"`{s}`", f"`{p}`", f"`{h}`"] for s, o in res.stamp.outs.items() for p, h in o.items()]))
    else:
        out.append("No dvc.lock in this workspace.")
    return "\n".join(out) + "\n"


def headline_block(res: WorkspaceResults, results_link: str, workspace_label: str | None = None) -> str:
    """The README's results block (markers included): a caption and the headline split's ablation table."""
    present = [s for v in res.evaluate.values() for s in v]
    split = HEADLINE_SPLIT if HEADLINE_SPLIT in present else (present[0] if present else HEADLINE_SPLIT)
    caption = (
        f"The ablation on the {split} re-ranking examples, generated by `gr2 results` from `{workspace_label or res.root}` "
        f"({_stamp_line(res.stamp)}). Every table, the speed and the stage times: [{results_link}]({results_link})."
    )
    return "\n".join([RESULTS_BEGIN, caption, "", ablation_table(res.evaluate, split), RESULTS_END])


def replace_block(text: str, block: str, *, name: str = "README") -> str:
    """`text` with the lines from RESULTS_BEGIN to RESULTS_END (inclusive) replaced by `block`.

    Raises ResultsError naming `name` when the markers are missing, repeated or out of order."""
    begin, end = text.count(RESULTS_BEGIN), text.count(RESULTS_END)
    if begin != 1 or end != 1:
        raise ResultsError(f"{name}: needs exactly one {RESULTS_BEGIN} and one {RESULTS_END} line (found {begin} and {end})")
    start, stop = text.index(RESULTS_BEGIN), text.index(RESULTS_END)
    if stop < start:
        raise ResultsError(f"{name}: {RESULTS_END} comes before {RESULTS_BEGIN}")
    return text[:start] + block + text[stop + len(RESULTS_END) :]


def write_results(root: Path, out: Path, readme: Path | None, label: str | None = None) -> list[Path]:
    """Write `out` (docs/results.md) from the workspace `root` and, unless `readme` is None, rewrite its
    results block. `label` names the workspace on the page (default: its path, relative to the current
    folder when inside it). Returns the paths written. ResultsError (naming the file) on a missing or
    malformed input."""
    res = load_results(root)
    label = label or _label(Path(root), Path.cwd())
    text = render_results(res, label)
    if readme is not None:
        if not readme.is_file():
            raise ResultsError(f"{readme}: not found (pass --readme PATH, or --no-readme)")
        link = Path(os.path.relpath(out.resolve(), readme.resolve().parent)).as_posix()
        new_readme = replace_block(readme.read_text(), headline_block(res, link, label), name=str(readme))
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(out, text)
    written = [out]
    if readme is not None:
        _write_atomic(readme, new_readme)
        written.append(readme)
    return written


def _label(root: Path, cwd: Path) -> str:
    """How the page names its workspace: relative to the current folder when inside it ('.' for the project)."""
    try:
        rel = root.resolve().relative_to(cwd.resolve())
    except ValueError:
        return str(root.resolve())
    return rel.as_posix() or "."


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
