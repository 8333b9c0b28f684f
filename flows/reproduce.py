"""Lineage-tracked reproduction: rebuild a registered model from its commit and data hash, compare.

    gr2 reproduce gr2@champion            # or: gr2 reproduce diffusion-gr2 3

What a version carries (set when it is registered, flows/pipeline.py):
- tags `git.commit` and `git.dirty` (the code and params.yaml it was made from),
  `checkpoint_md5` (DVC's hash of its checkpoint), `dvc.dep.*` / `dvc.out.*`,
  and `runtime.*` (thread count, CPU count, torch and Python versions; the launcher
  `runtime.launch`, `runtime.num_processes` and the accelerate config the stage ran with);
- artifacts `lineage/dvc.lock` (the hashes of every stage's inputs and outputs at
  registration: the raw data snapshot, the code files, the params, each
  intermediate output) and `lineage/metrics/<stage>.json` (each stage's metrics).

Reproduction checks out the commit into a temporary git worktree, restores the
source data by its recorded hash from the DVC remote (the project's default
remote, else its local cache), reruns every stage up to the model's with
`dvc repro --force` (tracking off: nothing is written to the registry but the
verdict), then compares stage by stage: the inputs (code, params, data) must
hash as recorded, the outputs (data, checkpoints) and the stage metrics
(timings ignored) are checked against the recorded ones. Verdicts:

- `bit-for-bit`: the rebuilt checkpoint has the registered hash and every
  metric is equal;
- `within-tolerance`: the checkpoint differs, every metric is within `rtol`;
- `not-reproduced`: something differs; the report names the first stage whose
  outputs differ from identical inputs;
- `not-reproducible`: the version cannot be rebuilt as recorded (registered from
  a dirty tree, commit or data missing, no lineage).

The verdict is also written on the version as tags `reproduce.*`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version as pkg_version
from pathlib import Path
from typing import Any

import yaml

from flows.snapshot import default_remote, dvc, git, inside, pointer_md5

log = logging.getLogger("flows.reproduce")

LINEAGE_DIR = "lineage"
LOCK_ARTIFACT = f"{LINEAGE_DIR}/dvc.lock"
BIT_FOR_BIT, WITHIN_TOLERANCE, NOT_REPRODUCED, NOT_REPRODUCIBLE = "bit-for-bit", "within-tolerance", "not-reproduced", "not-reproducible"


class ReproduceError(RuntimeError):
    """Nothing to reproduce: unknown model, version or alias, or a version that was never registered by the pipeline."""


# ---------------------------------------------------------------------------
# What the pipeline records at registration


def runtime_tags() -> dict[str, str]:
    """The parts of the environment that change floating-point results: thread count, CPUs, versions.

    Bit-for-bit equality holds for the same thread count (measured on the smoke
    profile with OMP_NUM_THREADS=1); reproduction reruns with the recorded one.
    """
    return {
        "runtime.omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "runtime.cpu_count": str(os.cpu_count()),
        "runtime.torch": pkg_version("torch"),
        "runtime.python": platform.python_version(),
    }


def record_lineage(client: Any, root: Path, stage: str, run_id: str) -> None:
    """Log dvc.lock and every stage's metrics file, as they are now, under `lineage/` of the stage's run."""
    root = root.resolve()
    lock = root / "dvc.lock"
    if lock.exists():
        client.log_text(run_id, lock.read_text(), LOCK_ARTIFACT)
    for path in sorted((root / "metrics").glob("*.json")):
        client.log_text(run_id, path.read_text(), f"{LINEAGE_DIR}/metrics/{path.name}")


# ---------------------------------------------------------------------------
# Comparing


def is_timing(key: str) -> bool:
    """Metrics that measure time, not results (`seconds`, `train_s`, `tokens_per_s`): never compared."""
    last = key.split(".")[-1]
    return last == "seconds" or last.endswith("_s") or last in ("speedup",)


def numeric_leaves(d: Any, prefix: str = "") -> dict[str, float]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1.0}`; numbers only (bools and strings are kept as strings)."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(numeric_leaves(v, f"{prefix}{k}."))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out.update(numeric_leaves(v, f"{prefix}{i}."))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out[prefix[:-1]] = float(d)
    else:
        out[prefix[:-1]] = str(d)
    return out


@dataclass
class MetricCheck:
    key: str
    recorded: Any
    rebuilt: Any
    equal: bool  # exactly
    close: bool  # within rtol


def compare_metrics(recorded: dict[str, Any], rebuilt: dict[str, Any], rtol: float) -> list[MetricCheck]:
    """Every non-timing leaf of either metrics dict, recorded vs rebuilt."""
    a, b = numeric_leaves(recorded), numeric_leaves(rebuilt)
    out = []
    for key in sorted(set(a) | set(b)):
        if is_timing(key):
            continue
        x, y = a.get(key), b.get(key)
        equal = x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        close = equal or (isinstance(x, float) and isinstance(y, float) and math.isclose(x, y, rel_tol=rtol, abs_tol=rtol * 1e-3))
        out.append(MetricCheck(key, x, y, equal, close))
    return out


def _lock_stages(text: str | None) -> dict[str, dict[str, Any]]:
    if not text:
        return {}
    stages = (yaml.safe_load(text) or {}).get("stages", {})
    out = {}
    for name, entry in stages.items():
        out[name] = {
            "deps": {d["path"]: d.get("md5") for d in entry.get("deps", [])},
            "outs": {o["path"]: o.get("md5") for o in entry.get("outs", [])},
            "params": entry.get("params", {}),
        }
    return out


def source_data(lock: dict[str, dict[str, Any]], stages: list[str]) -> dict[str, str]:
    """Deps of `stages` that no stage produces and that are folders: the raw data the pipeline starts from."""
    produced = {p for entry in lock.values() for p in entry["outs"]}
    out = {}
    for s in stages:
        for path, md5 in lock.get(s, {}).get("deps", {}).items():
            if path not in produced and str(md5).endswith(".dir"):
                out[path] = md5
    return out


@dataclass
class StageCheck:
    stage: str
    status: str  # "identical" | "inputs differ" | "outputs differ" | "not recorded"
    details: list[str] = field(default_factory=list)


def compare_stage(stage: str, recorded: dict[str, Any] | None, rebuilt: dict[str, Any] | None, metrics: list[MetricCheck]) -> StageCheck:
    """One stage's recorded vs rebuilt dvc.lock entry (metrics files compared by their numbers instead)."""
    if recorded is None or rebuilt is None:
        return StageCheck(stage, "not recorded", [f"no dvc.lock entry {'recorded' if recorded is None else 'rebuilt'}"])

    def diff(kind: str) -> list[str]:
        rec, new = recorded[kind], rebuilt[kind]
        return [
            f"{kind[:-1]} {p}: recorded {str(rec.get(p))[:12]}, rebuilt {str(new.get(p))[:12]}"
            for p in sorted(set(rec) | set(new))
            if not p.startswith("metrics/") and rec.get(p) != new.get(p)
        ]

    inputs = diff("deps") + (["params differ: " + json.dumps(recorded["params"])[:200]] if recorded["params"] != rebuilt["params"] else [])
    outputs = diff("outs") + [f"metric {m.key}: recorded {m.recorded}, rebuilt {m.rebuilt}" for m in metrics if not m.equal]
    if inputs:
        return StageCheck(stage, "inputs differ", inputs + outputs)
    if outputs:
        return StageCheck(stage, "outputs differ", outputs)
    return StageCheck(stage, "identical", [])


# ---------------------------------------------------------------------------
# The report


@dataclass
class Report:
    model: str
    version: str
    stage: str = ""
    commit: str = ""
    verdict: str = NOT_REPRODUCIBLE
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stages: list[StageCheck] = field(default_factory=list)
    checkpoint: str = ""
    checkpoint_recorded: str = ""
    checkpoint_rebuilt: str | None = None
    metrics: list[MetricCheck] = field(default_factory=list)
    seconds: float = 0.0
    worktree: str | None = None

    @property
    def reproduced(self) -> bool:
        return self.verdict in (BIT_FOR_BIT, WITHIN_TOLERANCE)

    def summary(self) -> str:
        what = f"{self.model} version {self.version}" + (f" (stage {self.stage})" if self.stage else "")
        if self.verdict == BIT_FOR_BIT:
            n = len(self.metrics)
            return f"REPRODUCED bit for bit: {what}: checkpoint md5 {self.checkpoint_recorded} rebuilt identical, {n} metrics equal"
        if self.verdict == WITHIN_TOLERANCE:
            return f"REPRODUCED within tolerance: {what}: metrics within rtol, checkpoint differs ({self.checkpoint_recorded} -> {self.checkpoint_rebuilt}); " + "; ".join(self.reasons)
        if self.verdict == NOT_REPRODUCED:
            return f"NOT REPRODUCED: {what}: " + "; ".join(self.reasons)
        return f"NOT REPRODUCIBLE: {what}: " + "; ".join(self.reasons)

    def text(self) -> str:
        lines = [f"{self.model} version {self.version}: stage {self.stage or '?'}, commit {self.commit[:12] or '?'}"]
        lines += [f"  {n}" for n in self.notes]
        if self.stages:
            lines += ["", f"{'stage':<14} result"]
            for s in self.stages:
                lines.append(f"{s.stage:<14} {s.status}")
                lines += [f"{'':<16}{d}" for d in s.details[:8]] + ([f"{'':<16}... {len(s.details) - 8} more"] if len(s.details) > 8 else [])
        if self.checkpoint_rebuilt is not None:
            same = "identical" if self.checkpoint_rebuilt == self.checkpoint_recorded else "DIFFERENT"
            lines += ["", f"checkpoint {self.checkpoint}: registered {self.checkpoint_recorded}, rebuilt {self.checkpoint_rebuilt}: {same}"]
        if self.metrics:
            unequal = [m for m in self.metrics if not m.equal]
            lines.append(f"metrics of {self.stage}: {len(self.metrics)} compared (timings ignored), {len(self.metrics) - len(unequal)} equal")
            lines += [f"  {m.key}: registered {m.recorded}, rebuilt {m.rebuilt}{'' if m.close else '  (beyond rtol)'}" for m in unequal[:12]]
        if self.seconds:
            lines.append(f"rebuilt in {self.seconds:.0f} s" + (f"; worktree kept at {self.worktree}" if self.worktree else ""))
        lines += ["", self.summary()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "reproduced": self.reproduced, "summary": self.summary()}


# ---------------------------------------------------------------------------
# Reproducing


def resolve(client: Any, ref: str, version: str | None = None) -> tuple[str, Any]:
    """`MODEL@ALIAS`, or `MODEL` with `version` -> (model name, the ModelVersion)."""
    from mlflow.exceptions import MlflowException

    ref = ref.removeprefix("models:/")
    if "@" in ref:
        if version is not None:
            raise ReproduceError(f"give either {ref} or a version, not both")
        name, alias = ref.split("@", 1)
        try:
            return name, client.get_model_version_by_alias(name, alias)
        except MlflowException as exc:
            raise ReproduceError(f"{name} has no version aliased '{alias}' in {client.tracking_uri}") from exc
    if "/" in ref and version is None:
        ref, version = ref.split("/", 1)
    if version is None:
        raise ReproduceError(f"which version of {ref}? give MODEL@ALIAS (e.g. {ref}@champion) or MODEL VERSION")
    try:
        return ref, client.get_model_version(ref, str(version))
    except MlflowException as exc:
        raise ReproduceError(f"{ref} has no version {version} in {client.tracking_uri}") from exc


def _lineage(client: Any, run_id: str, dest: Path) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """(recorded dvc.lock text, {stage: metrics}) from the version's run, or (None, {}) if it has none."""
    import mlflow.artifacts

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        local = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=LINEAGE_DIR, dst_path=str(dest), tracking_uri=client.tracking_uri))
    except Exception:  # noqa: BLE001 - no lineage logged (a version registered before lineage existed)
        return None, {}
    lock = local / "dvc.lock"
    metrics = {p.stem: json.loads(p.read_text()) for p in sorted((local / "metrics").glob("*.json"))} if (local / "metrics").is_dir() else {}
    return (lock.read_text() if lock.exists() else None), metrics


def _remote_url(root: Path, override: str | None) -> tuple[str, str]:
    """(URL, where it came from): the override, the project's default remote, else its local cache."""
    if override:
        return (override if "://" in override else str(Path(override).resolve())), "--remote"
    remote = default_remote(root)
    if remote:
        return remote["url"], f"default remote '{remote['name']}'"
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        cache = Path(repo.cache.local.path).parent.parent  # <cache>/files/md5 -> <cache>, laid out like a remote
    return str(cache), "the project's local DVC cache (no default remote configured)"


def _run_repro(wt: Path, stage: str, env: dict[str, str]) -> tuple[int, list[str]]:
    """`dvc repro --force STAGE` in the worktree: every stage up to STAGE, from scratch; output streamed to the log."""
    cmd = [sys.executable, "-m", "dvc", "repro", "--force", stage]
    proc = subprocess.Popen(cmd, cwd=wt, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    tail: list[str] = []
    assert proc.stdout is not None
    last = 0.0
    for line in proc.stdout:
        line = line.rstrip().split("\r")[-1]
        if not line:
            continue
        tail = (tail + [line])[-30:]
        if "%|" in line and time.monotonic() - last < 5:
            continue
        last = time.monotonic()
        log.info("[rebuild] %s", line)
    return proc.wait(), tail


def _rebuild_env(wt: Path, tags: dict[str, str], notes: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_RUN") and k not in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")}
    env.update({"GR2_TRACKING": "off", "GR2_ROOT": str(wt), "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1"})
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    threads = tags.get("runtime.omp_num_threads")
    if threads and threads.isdigit():
        if env.get("OMP_NUM_THREADS") != threads:
            notes.append(f"OMP_NUM_THREADS={threads} as when it was built (here: {env.get('OMP_NUM_THREADS', 'unset')})")
        env["OMP_NUM_THREADS"] = threads
    elif threads == "unset" and str(os.cpu_count()) != tags.get("runtime.cpu_count"):
        notes.append(f"built with torch's default thread count on {tags.get('runtime.cpu_count')} CPUs, rebuilt on {os.cpu_count()}: floating-point results may differ")
    if tags.get("runtime.torch") and tags["runtime.torch"] != pkg_version("torch"):
        notes.append(f"built with torch {tags['runtime.torch']}, rebuilt with {pkg_version('torch')}")
    _rebuild_launch(env, tags, notes)
    return env


def _rebuild_launch(env: dict[str, str], tags: dict[str, str], notes: list[str]) -> None:
    """Rerun under the launcher the version's stage ran with (`runtime.launch`, tasks.common.stage_main).

    The results do not depend on the process count by design (global batches, decoding
    gathered in a fixed order), but floating-point sums do, to ~1e-6: the same launcher
    is what makes bit-for-bit possible. A config file named in it is read from the
    rebuilt commit's worktree (the rebuild's working folder).
    """
    from tasks.common import LAUNCH_ENV

    launch = tags.get("runtime.launch")
    mine = env.get(LAUNCH_ENV, "")
    if launch is None:  # registered before launchers were recorded: one process
        env.pop(LAUNCH_ENV, None)
        return
    if launch == "external":
        notes.append(f"built under a launcher run by hand ({tags.get('runtime.num_processes', '?')} processes), rebuilt with {LAUNCH_ENV}={mine!r}")
        return
    wanted = "" if launch == "python" else launch
    if wanted != mine:
        notes.append(f"{LAUNCH_ENV}={wanted!r} as when it was built ({tags.get('runtime.num_processes', '?')} processes; here: {mine!r})")
    if wanted:
        env[LAUNCH_ENV] = wanted
    else:
        env.pop(LAUNCH_ENV, None)


def reproduce(
    ref: str,
    version: str | None = None,
    root: Path = Path("."),
    remote: str | None = None,
    rtol: float = 0.0,
    keep: bool = False,
    record: bool = True,
    client: Any | None = None,
) -> Report:
    """Rebuild a registered version from its lineage and compare; see the module docstring.

    Raises ReproduceError when the model, alias or version does not exist;
    every other outcome is a Report with a verdict.
    """
    from mlflow import MlflowClient

    from flows.dvc_stages import stage_order
    from flows.registry import MODEL_STAGES
    from tasks.tracking import configure

    root = root.resolve()
    configure(root)
    client = client or MlflowClient()
    name, mv = resolve(client, ref, version)
    tags = dict(mv.tags)
    report = Report(model=name, version=str(mv.version), stage=tags.get("stage", ""), commit=tags.get("git.commit", ""))
    spec = MODEL_STAGES.get(report.stage)
    if "verifier.model_version" in tags:
        # A speculative version is made of two checkpoints that other stages built: rebuild those.
        raise ReproduceError(
            f"{name} version {mv.version} bundles two registered checkpoints and trains nothing itself; reproduce its sources: "
            f"{tags['verifier.model']} version {tags['verifier.model_version']} and {tags.get('drafter.model')} version {tags.get('drafter.model_version')}"
        )
    if spec is None:
        raise ReproduceError(f"{name} version {mv.version} has no pipeline stage tag (stage={report.stage!r}); it was not registered by the pipeline")
    report.checkpoint, report.checkpoint_recorded = spec.checkpoint, tags.get("checkpoint_md5", "")

    def finish(verdict: str, *reasons: str) -> Report:
        report.verdict = verdict
        report.reasons += list(reasons)
        if record:
            _record(client, report)
        return report

    # What makes a version impossible to rebuild as recorded, checked before any work.
    dirty = tags.get("git.dirty")
    if dirty != "false":
        return finish(
            NOT_REPRODUCIBLE,
            "registered from a dirty git tree (uncommitted code or params)" if dirty == "true" else f"git state unknown (git.dirty={dirty!r})",
        )
    if len(report.commit) != 40:
        return finish(NOT_REPRODUCIBLE, f"no git commit recorded (git.commit={report.commit!r})")
    if git(root, "cat-file", "-e", f"{report.commit}^{{commit}}", check=False).returncode != 0:
        return finish(NOT_REPRODUCIBLE, f"commit {report.commit[:12]} is not in the repository at {root}")

    work = Path(tempfile.mkdtemp(prefix="gr2-reproduce-"))
    wt = work / "src"
    start = time.perf_counter()
    try:
        lock_text, recorded_metrics = _lineage(client, tags.get("run_id", mv.run_id), work / "lineage")
        if lock_text is None:
            return finish(NOT_REPRODUCIBLE, f"no lineage artifacts ({LOCK_ARTIFACT}) on run {mv.run_id}: registered before lineage was recorded")
        recorded = _lock_stages(lock_text)
        git(root, "worktree", "add", "--detach", "-f", str(wt), report.commit)
        order = stage_order(wt)
        if report.stage not in order:
            return finish(NOT_REPRODUCIBLE, f"stage {report.stage} is not in dvc.yaml at commit {report.commit[:12]}")
        upto = order[: order.index(report.stage) + 1]

        # Source data by hash from the remote (a folder inside the project); an external
        # folder is read in place and checked against the recorded hash afterwards.
        url, where = _remote_url(root, remote)
        dvc(wt, "remote", "add", "--local", "--force", "-d", "gr2-origin", url)
        for path, md5 in source_data(recorded, upto).items():
            if Path(path).is_absolute() or not inside(wt, path):
                report.notes.append(f"data {path}: outside the project, read in place (not versioned by DVC)")
                continue
            pointer = wt / f"{path}.dvc"
            if pointer_md5(pointer) != md5:
                report.notes.append(f"data {path}: restoring the recorded hash {md5} (the commit's pointer names {pointer_md5(pointer)})")
                pointer.write_text(yaml.safe_dump({"outs": [{"md5": md5, "hash": "md5", "path": Path(path).name}]}))
            pulled = dvc(wt, "pull", "-q", str(pointer.relative_to(wt)), check=False)
            if pulled.returncode != 0:
                return finish(NOT_REPRODUCIBLE, f"data {path} ({md5}) could not be restored from {where} ({url}): {(pulled.stdout + pulled.stderr).strip()[-300:]}")
            report.notes.append(f"data {path}: {md5} restored from {where} ({url})")

        env = _rebuild_env(wt, tags, report.notes)
        log.info("rebuilding %s in %s: %s", report.stage, wt, " -> ".join(upto))
        rc, tail = _run_repro(wt, report.stage, env)
        report.seconds = round(time.perf_counter() - start, 1)
        if rc != 0:
            return finish(NOT_REPRODUCED, f"the rebuild failed (dvc repro exit {rc}): " + " | ".join(tail[-5:]))

        rebuilt = _lock_stages((wt / "dvc.lock").read_text())
        for path, md5 in source_data(recorded, upto).items():
            now = next((e["deps"][path] for e in rebuilt.values() if path in e["deps"]), None)
            if now != md5 and (Path(path).is_absolute() or not inside(wt, path)):
                return finish(NOT_REPRODUCIBLE, f"source data {path} has changed since (md5 {now}, recorded {md5}) and is not versioned by DVC; snapshot it (schedule.source)")
        for s in upto:
            new_metrics = json.loads((wt / "metrics" / f"{s}.json").read_text()) if (wt / "metrics" / f"{s}.json").exists() else {}
            checks = compare_metrics(recorded_metrics[s], new_metrics, rtol) if s in recorded_metrics else []
            report.stages.append(compare_stage(s, recorded.get(s), rebuilt.get(s), checks))
            if s == report.stage:
                report.metrics = checks
        report.checkpoint_rebuilt = rebuilt.get(report.stage, {}).get("outs", {}).get(spec.checkpoint)

        same_ckpt = report.checkpoint_rebuilt == report.checkpoint_recorded
        first_bad = next((s for s in report.stages if s.status != "identical"), None)
        if same_ckpt and all(m.equal for m in report.metrics):
            return finish(BIT_FOR_BIT)
        why = []
        if first_bad is not None:
            kind = "its inputs differ from the recorded ones" if first_bad.status == "inputs differ" else "from identical inputs its outputs differ (not deterministic)"
            why.append(f"first divergence at stage {first_bad.stage}: {kind}")
        if not same_ckpt:
            why.append(f"checkpoint md5 {report.checkpoint_rebuilt} != registered {report.checkpoint_recorded}")
        if rtol > 0 and report.metrics and all(m.close for m in report.metrics):
            return finish(WITHIN_TOLERANCE, *why)
        bad = [m.key for m in report.metrics if not m.close]
        if bad:
            why.append(f"{len(bad)} metrics differ ({', '.join(bad[:5])})")
        return finish(NOT_REPRODUCED, *why)
    finally:
        if keep and wt.exists():
            report.worktree = str(wt)
        else:
            git(root, "worktree", "remove", "--force", str(wt), check=False)
            shutil.rmtree(work, ignore_errors=True)
            git(root, "worktree", "prune", check=False)


def _record(client: Any, report: Report) -> None:
    """The verdict as tags on the version (`reproduce.verdict`, `.at`, `.summary`)."""
    tags = {
        "reproduce.verdict": report.verdict,
        "reproduce.at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "reproduce.summary": report.summary()[:4900],
    }
    try:
        for key, value in tags.items():
            client.set_model_version_tag(report.model, report.version, key, value)
    except Exception as exc:  # noqa: BLE001 - the verdict is printed either way
        log.warning("could not record the verdict on %s version %s: %s", report.model, report.version, exc)
