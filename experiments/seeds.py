"""Train `sft` and `ar_rl` with several seeds on a workspace's data and `gr2-base`; judge each seed on every example.

One training run is one sample: GR2's gain over the incoming order is a few
hundredths of R@1, about what two trainings of one recipe differ by. This
trains the same recipe once per seed and writes what each seed reached, and
the spread, to `reports/seeds.json` in the workspace:

    python experiments/seeds.py --root WORKSPACE --seeds 0 1 2
    python experiments/seeds.py --root WORKSPACE --seeds 1 2 --parallel 2 --threads 1   # two at once, one thread each
    python experiments/seeds.py --root WORKSPACE --seeds 0 1 --recipe soft20 --set sft.train.decision_weight=20

A recipe (`--recipe NAME` with one or more `--set KEY=VALUE`, dotted keys of
params.yaml, values read as YAML) trains the workspace's params with those
changes, its seeds in `WORKSPACE/recipes/NAME/seed<S>/`, and writes
`reports/seeds-NAME.json`; each of its seeds is also paired against the same
seed of the workspace's own recipe where that seed's figures exist
(`<metric>_vs_base` entries), so a lever is judged seed by seed.

Each seed of the workspace's own recipe trains in `WORKSPACE/seeds/seed<S>/`: a folder whose `data` and
`checkpoints/gr2-base` link to the workspace's, with the workspace's
params.yaml where `sft.seed`, `sft.train.seed`, `ar_rl.seed` and
`ar_rl.train.seed` are S, running `python -m tasks.sft` then
`python -m tasks.ar_rl` there with tracking off (the registry is for the
pipeline's own models). A seed whose params equal the workspace's (the
pipeline's own run) reuses the workspace's checkpoints instead of training
again; a seed folder whose checkpoints exist is not trained again either
(`--retrain` forces it). Every seed's gr2-sft and gr2 are then decoded on
every validation and test re-ranking example as `evaluate` decodes them
(greedy, no grammar, the strict parser), with paired bootstrap intervals of
R@1 and NDCG@3 against the incoming order.

reports/seeds.json: `{"seeds": {S: {split: {model: {recall@1, ndcg@3,
recall@1_vs_prerank, ndcg@3_vs_prerank, valid_permutation_rate, ...}}}},
"spread": {split: {model: {metric: {min, max, range, mean}}}}, "pooled": {split: {model |
"gr2_vs_gr2-sft": {metric: {diff, ci95}}}}, "commands": ...}`. "pooled" is the recipe's gain
with each example's gain averaged over the seeds first (paired bootstrap over examples).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.data.dataset import load_prepared
from gr2model.eval.rerank_eval import fixed_rankings, lm_rerank, rerank_examples
from gr2model.task.metrics import per_example_gain
from gr2model.task.rerank_format import ItemText
from tasks.common import write_json_atomic
from tasks.evaluate import CI_METRICS, add_intervals, paired_difference, paired_gain_difference, scored
from tasks.traces import load_format, load_lists

MODELS = {"gr2-sft": Path("checkpoints/gr2-sft"), "gr2": Path("checkpoints/gr2")}
REPORT = Path("reports/seeds.json")
# What a seed sets: the sft split and batch order, the RL prompt order, sampling and torch seed.
SEED_KEYS = (("sft", "seed"), ("sft", "train", "seed"), ("ar_rl", "seed"), ("ar_rl", "train", "seed"))
# The figures kept per seed, split and model (the intervals come with the _vs_prerank entries).
KEPT = ("recall@1", "ndcg@3", "recall@1_vs_prerank", "ndcg@3_vs_prerank", "valid_permutation_rate", "copy_incoming_rate", "n")


def seeded_params(params: dict[str, Any], seed: int) -> dict[str, Any]:
    """`params` with every key of SEED_KEYS set to `seed` (a deep copy)."""
    out = copy.deepcopy(params)
    for path in SEED_KEYS:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = seed
    return out


def seed_of_params(params: dict[str, Any]) -> int | None:
    """The seed the workspace's own params train with, when every SEED_KEYS entry agrees (a missing one counts as 0)."""
    values = set()
    for path in SEED_KEYS:
        node: Any = params
        for key in path:
            node = node.get(key, 0) if isinstance(node, dict) else 0
        values.add(int(node))
    return values.pop() if len(values) == 1 else None


def parse_overrides(pairs: list[str], params: dict[str, Any]) -> dict[str, Any]:
    """{dotted key: value} from `KEY=VALUE` strings, each key an existing leaf of `params`, each value read as YAML.

    Raises SystemExit naming the offending pair before anything trains."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE, e.g. sft.train.decision_weight=20")
        node: Any = params
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise SystemExit(f"--set {pair!r}: params.yaml has no field {key!r} (no {part!r} there)")
            node = node[part]
        if isinstance(node, dict):
            raise SystemExit(f"--set {pair!r}: {key!r} is a section, not a knob")
        value = yaml.safe_load(raw)
        if isinstance(node, float) and isinstance(value, str):
            try:  # YAML 1.1 reads 1e-3 as a string; the knob is a float
                value = float(value)
            except ValueError:
                raise SystemExit(f"--set {pair!r}: {key!r} is a number, not {raw!r}") from None
        out[key] = value
    return out


def with_overrides(params: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`params` (a deep copy) with each dotted key of `overrides` set."""
    out = copy.deepcopy(params)
    for key, value in overrides.items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node[part]
        node[leaf] = value
    return out


def seed_dir(root: Path, seed: int, recipe: str | None) -> Path:
    """Where one seed trains: WORKSPACE/seeds/seed<S> for the workspace's own recipe, else WORKSPACE/recipes/<recipe>/seed<S>."""
    return (root / "seeds" if recipe is None else root / "recipes" / recipe) / f"seed{seed}"


def prepare_seed_dir(root: Path, seed: int, params: dict[str, Any], recipe: str | None = None) -> Path:
    """The seed's folder (`seed_dir`): links to the workspace's data and gr2-base, and the seeded params.yaml."""
    work = seed_dir(root, seed, recipe)
    (work / "checkpoints").mkdir(parents=True, exist_ok=True)
    for link, target in ((work / "data", root / "data"), (work / "checkpoints" / "gr2-base", root / "checkpoints" / "gr2-base")):
        if not link.is_symlink():
            link.symlink_to(target.resolve(), target_is_directory=True)
    (work / "params.yaml").write_text(yaml.safe_dump(seeded_params(params, seed), sort_keys=False))
    return work


def train_seed(root: Path, seed: int, params: dict[str, Any], threads: int, retrain: bool, recipe: str | None = None) -> Path:
    """The folder holding this seed's gr2-sft and gr2, trained there unless they exist already."""
    own = recipe is None and seed_of_params(params) == seed
    if own and all((root / p).exists() for p in MODELS.values()) and not retrain:
        print(f"seed {seed}: the workspace's own params; its checkpoints are reused", flush=True)
        return root
    work = prepare_seed_dir(root, seed, params, recipe)
    env = {**os.environ, "GR2_TRACKING": "off", "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(root.resolve())}
    for stage, out in (("sft", MODELS["gr2-sft"]), ("ar_rl", MODELS["gr2"])):
        if (work / out).exists() and not retrain:
            print(f"seed {seed}: {out} exists; not trained again", flush=True)
            continue
        t0 = time.perf_counter()
        print(f"seed {seed}: {stage} in {work} ({threads} threads)", flush=True)
        with open(work / f"{stage}.log", "w") as log:
            done = subprocess.run([sys.executable, "-m", f"tasks.{stage}"], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode:
            raise SystemExit(f"seed {seed}: {stage} failed (exit {done.returncode}); its log: {work / f'{stage}.log'}")
        print(f"seed {seed}: {stage} done in {time.perf_counter() - t0:.0f} s", flush=True)
    return work


def figures_path(root: Path, seed: int, recipe: str | None = None) -> Path:
    """Where one seed's figures are kept, so a later call with more seeds decodes only the new ones."""
    return seed_dir(root, seed, recipe) / "figures.json"


def ranks_path(root: Path, seed: int, recipe: str | None = None) -> Path:
    """Where one seed's per-example ranks of the target are kept (for pairing a recipe against the base)."""
    return seed_dir(root, seed, recipe) / "ranks.npz"


def judge(
    root: Path, folders: dict[int, Path], splits: list[str], batch_size: int, max_new_tokens: int, recipe: str | None = None
) -> dict[int, dict[str, dict[str, dict[str, Any]]]]:
    """{seed: {split: {model: figures}}}: each seed's models decoded on every re-ranking example.

    A seed's figures are reused from `figures_path` when they were computed on the same
    splits after its checkpoints were last written."""
    fmt = load_format(root)
    ds, _ = load_prepared(root / "data/prepared")
    items = ItemText(ds.items)
    lists = {s: rerank_examples(load_lists(root, s)) for s in splits}
    out: dict[int, dict[str, dict[str, dict[str, Any]]]] = {}
    for seed, folder in folders.items():
        kept = figures_path(root, seed, recipe)
        newest = max((folder / p / "COMPLETE").stat().st_mtime for p in MODELS.values())
        # Without the kept ranks a seed cannot be paired against another recipe: decode it again.
        if kept.exists() and ranks_path(root, seed, recipe).exists() and kept.stat().st_mtime > newest:
            cached = {int(k): v for k, v in json.loads(kept.read_text()).items()}
            if seed in cached and sorted(cached[seed]) == sorted(splits):
                out[seed] = cached[seed]
                print(f"seed {seed}: figures reused from {kept}", flush=True)
                continue
        results: dict[str, dict[str, dict[str, Any]]] = {"prerank": {}}
        ranks: dict[str, dict[str, np.ndarray]] = {"prerank": {}}
        for split, df in lists.items():
            incoming = df["candidates"].to_list()
            results["prerank"][split], ranks["prerank"][split] = scored(fixed_rankings(incoming, incoming), df["target"].to_list())
        for name, path in MODELS.items():
            model, tok = load_hf_checkpoint(folder / path)
            results[name], ranks[name] = {}, {}
            for split, df in lists.items():
                res = lm_rerank(model.eval(), tok, df, items, fmt, batch_size=batch_size, max_new_tokens=max_new_tokens, desc=f"seed {seed} {name} {split}")
                results[name][split], ranks[name][split] = scored(res.parsed, df["target"].to_list())
        add_intervals(results, ranks, n_boot=2000, seed=0)
        kept.parent.mkdir(parents=True, exist_ok=True)  # the workspace's own seed trained in the workspace: no seed folder yet
        np.savez(ranks_path(root, seed, recipe), **{f"{name}/{split}": r for name, by in ranks.items() for split, r in by.items()})
        out[seed] = {split: {name: {k: results[name][split][k] for k in KEPT} for name in MODELS} for split in splits}
        write_json_atomic({str(seed): out[seed]}, kept)
        print(json.dumps({"seed": seed, **{s: {m: round(v["recall@1_vs_prerank"]["diff"], 4) for m, v in by.items()} for s, by in out[seed].items()}}), flush=True)
    return out


def against_base(root: Path, recipe: str, per_seed: dict[int, dict[str, dict[str, dict[str, Any]]]], n_boot: int = 2000) -> list[int]:
    """Add `recall@1_vs_base` and `ndcg@3_vs_base` (paired bootstrap, recipe minus base) to each
    recipe seed's figures where the same seed of the workspace's own recipe kept its ranks; the
    seeds so paired."""
    paired = []
    for seed, by_split in per_seed.items():
        base_file, own_file = ranks_path(root, seed), ranks_path(root, seed, recipe)
        if not (base_file.exists() and own_file.exists()):
            continue
        base, own = np.load(base_file), np.load(own_file)
        for split, by_model in by_split.items():
            for model, fig in by_model.items():
                key = f"{model}/{split}"
                if key in base and key in own:
                    for metric in ("recall@1", "ndcg@3"):
                        fig[f"{metric}_vs_base"] = paired_difference(own[key], base[key], metric, n_boot=n_boot, seed=0)
        paired.append(seed)
    return paired


def spread(per_seed: dict[int, dict[str, dict[str, dict[str, Any]]]]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """{split: {model: {metric: {min, max, range, mean}}}} over the seeds, for R@1, NDCG@3 and their gains."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    first = next(iter(per_seed.values()))
    for split, by_model in first.items():
        out[split] = {}
        for model in by_model:
            out[split][model] = {}
            for metric in ("recall@1", "ndcg@3", "recall@1_vs_prerank", "ndcg@3_vs_prerank"):
                v = [s[split][model][metric] for s in per_seed.values()]
                v = [x["diff"] if isinstance(x, dict) else x for x in v]
                out[split][model][metric] = {"min": min(v), "max": max(v), "range": max(v) - min(v), "mean": float(np.mean(v))}
    return out


def pooled(root: Path, seeds: list[int], splits: list[str], recipe: str | None = None, n_boot: int = 2000) -> dict[str, dict[str, dict[str, Any]]]:
    """{split: {model or "gr2_vs_gr2-sft": {metric: {"diff", "ci95"}}}}: the recipe's gain averaged over its seeds.

    Each example's gain is averaged over the seeds first (its ranks kept in `ranks_path`), then
    compared with the incoming order's (and GR2's with gr2-sft's) by the paired bootstrap over
    examples. The interval is over examples for these seeds: it narrows with more seeds as
    their own noise averages out, but it does not cover seeds not drawn."""
    kept = [np.load(ranks_path(root, s, recipe)) for s in seeds]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for split in splits:
        base = {m: per_example_gain(kept[0][f"prerank/{split}"], m) for m in CI_METRICS}
        mean = {
            (model, m): np.mean([per_example_gain(k[f"{model}/{split}"], m) for k in kept], axis=0)
            for model in MODELS for m in CI_METRICS
        }
        out[split] = {model: {} for model in (*MODELS, "gr2_vs_gr2-sft")}
        for (model, m), gain in mean.items():
            out[split][model][m] = paired_gain_difference(gain, base[m], n_boot=n_boot, seed=0)
        for m in CI_METRICS:
            out[split]["gr2_vs_gr2-sft"][m] = paired_gain_difference(mean[("gr2", m)], mean[("gr2-sft", m)], n_boot=n_boot, seed=0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="a workspace that ran `midtrain` (its data and checkpoints/gr2-base)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--parallel", type=int, default=1, help="seeds trained at once")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")), help="torch threads per training")
    p.add_argument("--retrain", action="store_true", help="train every seed again, even where its checkpoints exist")
    p.add_argument("--splits", default="valid,test")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--recipe", help="a name for the params changed by --set; its seeds train in WORKSPACE/recipes/NAME/")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="a params.yaml knob changed for this recipe (repeatable)")
    a = p.parse_args()
    root = a.root.resolve()
    if not (root / "checkpoints" / "gr2-base").exists():
        raise SystemExit(f"{root / 'checkpoints' / 'gr2-base'}: no such checkpoint; run `gr2 run --stage midtrain` in the workspace first")
    if bool(a.recipe) != bool(a.overrides):
        raise SystemExit("--recipe NAME and --set KEY=VALUE go together: a recipe is the workspace's params with some knobs changed")
    if a.recipe and not a.recipe.replace("-", "").replace("_", "").isalnum():
        raise SystemExit(f"--recipe {a.recipe!r}: letters, digits, '-' and '_' only (it names a folder)")
    base_params = yaml.safe_load((root / "params.yaml").read_text())
    overrides = parse_overrides(a.overrides, base_params)
    params = with_overrides(base_params, overrides)
    with ThreadPoolExecutor(max_workers=a.parallel) as pool:
        folders = dict(zip(a.seeds, pool.map(lambda s: train_seed(root, s, params, a.threads, a.retrain, a.recipe), a.seeds)))
    per_seed = judge(root, folders, a.splits.split(","), a.batch_size, a.max_new_tokens, a.recipe)
    paired = against_base(root, a.recipe, per_seed) if a.recipe else []
    report = {
        "recipe": a.recipe,
        "overrides": overrides,
        "paired_with_base": paired,
        "seeds": {str(s): v for s, v in per_seed.items()},
        "spread": spread(per_seed),
        "pooled": pooled(root, list(per_seed), a.splits.split(","), a.recipe),
        "folders": {str(s): str(f) for s, f in folders.items()},
        "command": " ".join(["python", "experiments/seeds.py", *sys.argv[1:]]),
    }
    out = root / (REPORT if a.recipe is None else REPORT.with_name(f"seeds-{a.recipe}.json"))
    write_json_atomic(report, out)
    print(f"written: {out}", flush=True)
    for split, by_model in report["spread"].items():
        for model, m in by_model.items():
            r = m["recall@1_vs_prerank"]
            print(f"{split} {model}: R@1 - prerank mean {r['mean']:+.4f}, min {r['min']:+.4f}, max {r['max']:+.4f}, range {m['recall@1']['range']:.4f}")
    for split, by_model in report["pooled"].items():
        for model, by_metric in by_model.items():
            d = by_metric["recall@1"]
            print(f"{split} {model}: R@1 averaged over the seeds {d['diff']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]" + ("" if "_vs_" in model else " over the incoming order"))
    for seed in paired:
        for split, by_model in per_seed[seed].items():
            for model, fig in by_model.items():
                d = fig["recall@1_vs_base"]
                print(f"seed {seed} {split} {model}: R@1 - base {d['diff']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]")


if __name__ == "__main__":
    main()
