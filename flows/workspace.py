"""A self-contained copy of the project with a params profile applied (smoke runs, tests, experiments).

The copy has its own git repository, DVC cache, MLflow store and outputs, so a
smoke run never touches the main project's state.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

# What a workspace needs: the code the stages run and the pipeline definition.
COPIED = ("gr2model", "tasks", "flows", "dvc.yaml", "params.yaml", "pyproject.toml", ".dvcignore")
PROFILES_DIR = "profiles"


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` on top of `base`, recursing into nested mappings."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def profile_params(root: Path, profile: str | None) -> dict[str, Any]:
    """params.yaml with `profiles/<profile>.yaml` merged over it."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    if profile:
        path = root / PROFILES_DIR / f"{profile}.yaml"
        if not path.exists():
            known = sorted(p.stem for p in (root / PROFILES_DIR).glob("*.yaml"))
            raise FileNotFoundError(f"{path}: no such profile (known: {known})")
        params = deep_merge(params, yaml.safe_load(path.read_text()) or {})
    return params


# Where a workspace made with `snapshot=True` keeps its DVC-versioned copy of the raw data.
SNAPSHOT_DIR = "raw"
REMOTE_DIR = "dvc-remote"


def make_workspace(
    src: Path,
    dest: Path,
    profile: str | None = None,
    data_dir: Path | None = None,
    snapshot: bool = False,
    remote: str | None = None,
) -> Path:
    """Copy the project into `dest` (which must not exist), apply the profile, init git and DVC.

    DVC's default remote is `remote` (a folder or a URL such as s3://bucket/path),
    by default the folder `dest/dvc-remote`. With `snapshot`, the data folder is
    copied into `dest/raw`, versioned by DVC (`raw.dvc` committed, the files
    pushed to the remote) and becomes `prepare.data_dir`; `schedule.source`
    names the folder it came from, which scheduled retraining snapshots again
    on every run (flows/snapshot.py).
    """
    src, dest = src.resolve(), dest.resolve()
    if dest.exists():
        raise FileExistsError(f"{dest} exists; choose a new folder")
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in COPIED:
        path = src / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=ignore)
        elif path.exists():
            shutil.copy2(path, dest / name)
    params = profile_params(src, profile)
    # The data folder is relative to the source project; make it absolute so the copy finds it.
    source = (data_dir or (src / params["prepare"]["data_dir"])).resolve()
    params["prepare"]["data_dir"] = str(source)
    if snapshot:
        params["prepare"]["data_dir"] = SNAPSHOT_DIR
        params["schedule"] = {**(params.get("schedule") or {}), "source": str(source)}
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (dest / ".gitignore").write_text(
        f"/mlflow.db\n/mlruns/\n/data/\n/checkpoints/\n/metrics/\n/reports/\n/.promote-*.lock\n/.gr2/\n__pycache__/\n/{SNAPSHOT_DIR}\n/{REMOTE_DIR}/\n"
    )
    dvcignore = dest / ".dvcignore"
    if f"/{REMOTE_DIR}/" not in (dvcignore.read_text() if dvcignore.exists() else ""):
        with open(dvcignore, "a") as fh:
            fh.write(f"\n/{REMOTE_DIR}/\n")
    git = ["git", "-c", "user.name=gr2", "-c", "user.email=gr2@localhost", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=dest, check=True)
    dvc = [sys.executable, "-m", "dvc"]
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    subprocess.run([*dvc, "init", "-q"], cwd=dest, check=True, env=env)
    # No analytics, and a default remote that reproduction restores data from by hash
    # (written directly: each `dvc config` call costs a CLI start). The default is
    # relative to .dvc/, so a copied or moved workspace keeps its own remote.
    remote_url = remote if remote and "://" in remote else str(Path(remote).resolve()) if remote else f"../{REMOTE_DIR}"
    if "://" not in remote_url:
        (dest / ".dvc" / remote_url).resolve().mkdir(parents=True, exist_ok=True)
    (dest / ".dvc" / "config").write_text(f"[core]\n    analytics = false\n    remote = storage\n['remote \"storage\"']\n    url = {remote_url}\n")
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", f"workspace from {src} (profile {profile})"], cwd=dest, check=True)
    if snapshot:
        from flows.snapshot import snapshot_data

        snapshot_data(dest, source, commit=True, push=True)
    return dest

