"""Data snapshots and the DVC remote: what scheduled retraining and reproduction need from DVC and git.

The pipeline reads its raw data from `prepare.data_dir`. When that folder is
inside the project it is versioned by DVC like any other data: `<data_dir>.dvc`
(committed to git) names its hash, the DVC cache and remote hold its files. A
refresh copies the folder new data arrives in (`schedule.source`) over it, runs
`dvc add`, commits the pointer file, and pushes the snapshot to the default
remote. A snapshot with new content changes the hash `prepare` depends on, so
DVC reruns `prepare` and then only the stages whose inputs actually changed;
an identical one changes nothing.

No Prefect and no MLflow here (both cost seconds to import); flows/schedule.py
wraps these in tasks.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tasks.common import read_params

log = logging.getLogger("flows.snapshot")

DVC_ENV = {"DVC_NO_ANALYTICS": "1"}
GIT_IDENTITY = ("-c", "user.name=gr2", "-c", "user.email=gr2@localhost")


class SnapshotError(RuntimeError):
    """The data cannot be snapshotted as configured (the message says what to change)."""


def dvc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the DVC CLI of this interpreter in `root` and capture its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=root, env={**os.environ, **DVC_ENV}, capture_output=True, text=True
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"dvc {' '.join(args)} failed in {root} (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run git in `root`; commits fall back to a `gr2` identity when none is configured."""
    ident: tuple[str, ...] = ()
    if args and args[0] == "commit":
        has_email = subprocess.run(["git", "config", "user.email"], cwd=root, capture_output=True, text=True).stdout.strip()
        ident = () if has_email else GIT_IDENTITY
    proc = subprocess.run(["git", *ident, *args], cwd=root, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {root} (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")
    return proc


def pointer_md5(pointer: Path) -> str | None:
    """The hash a `.dvc` pointer file names for its folder or file (None if there is none)."""
    if not pointer.exists():
        return None
    outs = (yaml.safe_load(pointer.read_text()) or {}).get("outs") or [{}]
    return outs[0].get("md5")


def data_dir(root: Path) -> str:
    """`prepare.data_dir` as written in params.yaml."""
    return str(read_params(root / "params.yaml")["prepare"]["data_dir"])


def inside(root: Path, path: str) -> bool:
    """Whether `path` (relative to `root`, or absolute) lies inside the project folder."""
    return (root / path).resolve().is_relative_to(root.resolve())


def _copy_tree(src: Path, dest: Path) -> None:
    """Replace `dest` with a copy of `src`, swapped in with renames (a failed copy leaves `dest` as it was).

    Contents only (no modes): the source may be read-only, the snapshot must be replaceable.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.snapshot.", dir=dest.parent))
    try:
        shutil.copytree(src, tmp / "new", copy_function=shutil.copyfile)
        if dest.exists():
            dest.rename(tmp / "old")
        (tmp / "new").rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def snapshot_data(root: Path, source: Path, commit: bool = True, push: bool = True) -> dict[str, Any]:
    """Copy `source` over the project's `prepare.data_dir`, version it with DVC, commit its pointer.

    Returns {"path", "md5", "previous", "changed", "commit", "pushed"}: the
    snapshot folder (relative to the root), its DVC hash and the one before,
    whether the content changed, the git commit made for the pointer (None when
    nothing changed or `commit` is off) and whether it went to the default remote.

    Raises:
        SnapshotError: the source is missing, or `prepare.data_dir` is not a folder
            inside the project that git can track a pointer for.
    """
    root = root.resolve()
    rel = data_dir(root)
    if not inside(root, rel) or Path(rel).is_absolute():
        raise SnapshotError(
            f"{root / 'params.yaml'}: prepare.data_dir is {rel!r}, outside the project; a snapshot must live inside it "
            "(e.g. `prepare.data_dir: raw`), with `schedule.source` naming the folder new data arrives in"
        )
    rel = os.path.normpath(rel)
    source = (root / source).resolve() if not source.is_absolute() else source
    dest = root / rel
    if not source.is_dir():
        raise SnapshotError(f"schedule.source: folder {source} does not exist")
    if source == dest.resolve():
        raise SnapshotError(f"schedule.source and prepare.data_dir are the same folder ({source}); the source must be elsewhere")
    pointer = root / f"{rel}.dvc"
    if git(root, "check-ignore", "-q", str(pointer.relative_to(root)), check=False).returncode == 0:
        raise SnapshotError(
            f"{pointer.relative_to(root)} would be ignored by git (prepare.data_dir {rel!r} is under an ignored folder such as data/); "
            "choose a folder git can track a pointer for, e.g. `prepare.data_dir: raw`"
        )
    previous = pointer_md5(pointer)
    _copy_tree(source, dest)
    dvc(root, "add", rel)
    md5 = pointer_md5(pointer)
    changed = md5 != previous
    made = None
    if commit:
        # `dvc add` writes the pointer and, the first time, a .gitignore entry for the folder.
        ignore = pointer.parent / ".gitignore"
        paths = [str(pointer.relative_to(root))] + ([str(ignore.relative_to(root))] if ignore.exists() else [])
        if git(root, "status", "--porcelain", "--", *paths).stdout.strip():
            git(root, "add", "--", *paths)
            git(root, "commit", "-q", "-m", f"data snapshot {rel} {md5} (from {source})", "--", *paths)
            made = git(root, "rev-parse", "HEAD").stdout.strip()
    pushed = False
    if push and default_remote(root):
        dvc(root, "push", "-q", str(pointer.relative_to(root)))
        pushed = True
    log.info("snapshot %s: %s (%s)%s", rel, md5, "new content" if changed else "unchanged", f", committed {made[:10]}" if made else "")
    return {"path": rel, "md5": md5, "previous": previous, "changed": changed, "commit": made, "pushed": pushed, "source": str(source)}


def default_remote(root: Path) -> dict[str, str] | None:
    """The project's default DVC remote: {"name", "url"} (URL absolute for local folders), or None."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        name = repo.config["core"].get("remote")
        if not name:
            return None
        return {"name": name, "url": str(repo.config["remote"][name]["url"])}


def add_default_remote(root: Path, url: str, name: str = "storage", local: bool = False) -> None:
    """Make `url` (a folder, s3://..., etc.) the project's default DVC remote (in .dvc/config, or config.local)."""
    if "://" not in url:
        Path(url).mkdir(parents=True, exist_ok=True)
    dvc(root, "remote", "add", "--force", "-d", *(["--local"] if local else []), name, url)


def push(root: Path) -> bool:
    """`dvc push` everything the project tracks to its default remote; False when it has none."""
    if not default_remote(root):
        log.info("no default DVC remote in %s: nothing pushed (`dvc remote add -d NAME URL` to add one)", root)
        return False
    dvc(root, "push", "-q")
    return True
