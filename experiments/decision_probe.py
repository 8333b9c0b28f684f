"""Can a student learn the re-ranking decision from these labels? A lever probe on a pipeline workspace.

Trains a fresh student of the `midtrain.model` size on answer-only responses
(`{ "recommendations" : [ ... ] , "explanation" : " " }`, the first item
followed by the rest in the incoming order) for every training re-ranking
example of the workspace, labelled one of three ways:

- `rejection`: the target, on the examples the traces stage kept by rejection
  sampling (data/traces/train.parquet `kept`; run traces with `mode: rejection`);
- `targeted`: the target, on every example;
- `distill`: the teacher's own first choice (data/traces/teacher.json and
  teacher_ltr.txt, cross-fitted co-purchase statistics as in `traces`), on every example.

It then reads the decision on every validation re-ranking example: one forward
over the prompt and `{ "recommendations" : [ "`, the argmax over the K position
tokens, and reports R@1 and NDCG@3 against the incoming order with paired
bootstrap intervals, and how often the student keeps the incoming first item.
Answer-only training isolates the decision from the explanation;
`--responses traces` trains the traces as the `traces` stage wrote them (what
`sft` trains on), `--init checkpoints/gr2-base` starts where `sft` starts, and
`--answer-weight` sets the answer tokens' loss weight (sft.train.answer_weight),
and `--extra-lists N` adds N training lists whose target is not among the
candidates, labelled with the teacher's choice (what traces.unlabelled_lists
adds to `sft`'s data).

    python experiments/decision_probe.py --root WORKSPACE --labels distill --epochs 2

Prints one JSON line. Measured results: README "Measured here".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import torch

from gr2model.models.ar_model import count_parameters
from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.data.dataset import load_prepared
from gr2model.task.metrics import ranking_metrics
from gr2model.eval.rerank_eval import prompts_of, rerank_examples
from gr2model.task.rerank_format import FormatConfig, ItemText, build_response, pos_token
from gr2model.training.sft import SFTConfig, train_sft
from tasks.evaluate import add_intervals, load_teacher
from tasks.midtrain import MidtrainConfig, build_model_and_tokenizer
from tasks.traces import load_format, load_lists, user_folds_from_lists

PREFIX = '{ "recommendations" : [ "'  # what an answer-first response writes before its first choice


def answer(first: int, candidates: list[int], items: ItemText, fmt: FormatConfig) -> str:
    """Answer-first response with an empty explanation, promoting incoming position
    `first` (1-based) with the rest in the incoming order."""
    ranking = [candidates[first - 1]] + [c for i, c in enumerate(candidates, start=1) if i != first]
    return build_response([], ranking, items, fmt=replace(fmt, answer_first=True), candidates=candidates)


def teacher_firsts(root: Path, ds, split: pl.DataFrame, lists: pl.DataFrame) -> np.ndarray:
    """(n,) 1-based incoming position of the teacher's top candidate in each list (cross-fitted, as `traces`)."""
    folds = user_folds_from_lists(split, pl.read_parquet(root / "data/candidates/train.parquet"))
    teacher = load_teacher(root, ds.items, split["train"].to_list(), ds.num_items, folds=folds)
    rows = zip(lists["history"].to_list(), lists["candidates"].to_list(), lists["cand_scores"].to_list(), lists["fold"].to_list())
    return np.array([int(np.argmax(teacher.score(h, c, s, fold=f))) + 1 for h, c, s, f in rows])


def ranks_after_promotion(promoted: np.ndarray, incoming: np.ndarray) -> np.ndarray:
    """(n,) 0-based rank of each target once the item at 1-based incoming position
    `promoted` goes first and the rest keep the incoming order.

    Args:
        promoted: (n,) 1-based positions moved to the top.
        incoming: (n,) 0-based ranks of the targets in the incoming order.
    """
    # The promoted item goes to 0; items that stood before it move down by one; those after it stay.
    return np.where(promoted == incoming + 1, 0, np.where(incoming + 1 < promoted, incoming + 1, incoming))


@torch.no_grad()
def read_decisions(model, tok, prompts: list[str], k: int, batch_size: int = 64) -> np.ndarray:
    """(n,) 1-based position the model promotes: argmax over <pos_1..k> after the answer prefix."""
    pos_ids = [tok.convert_tokens_to_ids(pos_token(j)) for j in range(1, k + 1)]
    ids = [tok(p + " " + PREFIX, add_special_tokens=False)["input_ids"] for p in prompts]
    out = []
    for s in range(0, len(ids), batch_size):
        chunk = ids[s : s + batch_size]
        x = torch.full((len(chunk), max(map(len, chunk))), tok.pad_token_id)
        mask = torch.zeros_like(x)
        for i, c in enumerate(chunk):
            x[i, : len(c)] = torch.tensor(c)
            mask[i, : len(c)] = 1
        logits = model(input_ids=x, attention_mask=mask).logits
        last = logits[torch.arange(len(chunk)), mask.sum(1) - 1]
        out += (last[:, pos_ids].argmax(-1) + 1).tolist()
    return np.array(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="a workspace that ran `traces`")
    p.add_argument("--labels", choices=["rejection", "targeted", "distill"], default="distill")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-examples", type=int, default=0, help="train on the first N shuffled examples (0: all)")
    p.add_argument("--init", type=Path, default=None, help="start from this checkpoint (e.g. checkpoints/gr2-base) instead of a fresh student")
    p.add_argument("--responses", choices=["answer", "traces"], default="answer",
                   help="answer: answer-only responses with the --labels first item; traces: the traces as written (their own ranking and explanation)")
    p.add_argument("--extra-lists", type=int, default=0,
                   help="also train on N random training lists whose target is not among the candidates, labelled with the teacher's choice (answer only; needs --labels distill)")
    p.add_argument("--answer-weight", type=float, default=None, help="loss weight of the answer tokens (default: 1 for answer-only, sft's 2 for traces)")
    a = p.parse_args()
    root = a.root
    torch.manual_seed(a.seed)
    fmt = load_format(root)
    if fmt.answer != "index":
        raise SystemExit(f"{root}/data/traces/format.json: answer {fmt.answer!r}; the probe reads the decision as a position token (answer 'index')")
    ds, split = load_prepared(root / "data/prepared")
    traces = pl.read_parquet(root / "data/traces/train.parquet").select("user_id", "position", "kept", "prompt", "response")
    lists = rerank_examples(load_lists(root, "train")).join(traces, on=["user_id", "position"], how="inner", maintain_order="left")
    items = ItemText(ds.items)
    if a.labels == "rejection":
        mode = json.loads((root / "data/traces/teacher.json").read_text())["config"]["mode"]
        if mode != "rejection":
            raise SystemExit(f"{root}/data/traces: written with traces.mode {mode!r}; --labels rejection needs mode 'rejection'")
        lists = lists.filter(pl.col("kept"))
    if a.responses == "traces":
        lists = lists.filter(pl.col("response") != "")
        pairs = list(zip(lists["prompt"].to_list(), lists["response"].to_list()))
    else:
        firsts = teacher_firsts(root, ds, split, lists) if a.labels == "distill" else lists["target_rank"].to_numpy() + 1
        rows = zip(lists["prompt"].to_list(), firsts, lists["candidates"].to_list())
        pairs = [(prompt, answer(int(f), cands, items, fmt)) for prompt, f, cands in rows]
    if a.extra_lists:
        if a.labels != "distill":
            raise SystemExit("--extra-lists has no target to label with; use --labels distill")
        extra = load_lists(root, "train").filter(pl.col("target_rank") < 0)
        extra = extra.sample(min(a.extra_lists, extra.height), seed=a.seed)
        firsts = teacher_firsts(root, ds, split, extra)
        print(f"extra lists: {extra.height}, teacher keeps the incoming first on {(firsts == 1).mean():.4f}", file=sys.stderr)
        rows = zip(prompts_of(extra, items, fmt), firsts, extra["candidates"].to_list())
        pairs += [(prompt, answer(int(f), cands, items, fmt)) for prompt, f, cands in rows]
    random.Random(a.seed).shuffle(pairs)
    if a.max_examples:
        pairs = pairs[: a.max_examples]

    if a.init is not None:
        model, tok = load_hf_checkpoint(a.init)
    else:
        size = MidtrainConfig.model_validate(_midtrain_params(root)).model
        model, tok = build_model_and_tokenizer(MidtrainConfig(model=size, seed=a.seed), ds.items, len(fmt.evidence))
    answer_weight = a.answer_weight if a.answer_weight is not None else (1.0 if a.responses == "answer" else 2.0)
    cfg = SFTConfig(epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, answer_weight=answer_weight, seed=a.seed)
    t0 = time.perf_counter()
    model = train_sft(model, tok, pairs, cfg).model.eval()
    train_s = time.perf_counter() - t0

    valid = rerank_examples(load_lists(root, "valid"))
    promoted = read_decisions(model, tok, prompts_of(valid, items, fmt), len(valid["candidates"][0]))
    incoming = valid["target_rank"].to_numpy()  # 0-based rank of the target in the incoming order
    ranks = {"prerank": {"valid": incoming}, "probe": {"valid": ranks_after_promotion(promoted, incoming)}}
    results = {name: {"valid": ranking_metrics(r["valid"], (1, 3, 5), (3, 5))} for name, r in ranks.items()}
    add_intervals(results, ranks, n_boot=2000, seed=0)  # evaluate's intervals: paired differences to prerank
    out: dict[str, object] = {"labels": a.labels, "responses": a.responses, "init": str(a.init), "answer_weight": answer_weight,
                              "train_examples": len(pairs), "parameters": count_parameters(model), "epochs": a.epochs,
                              "train_s": round(train_s, 1), "copy_incoming_rate": float((promoted == 1).mean()),
                              **results["probe"]["valid"]}  # fmt: skip
    print(json.dumps(out))


def _midtrain_params(root: Path) -> dict:
    import yaml  # the workspace's params: the probe's student has the pipeline's model size

    return yaml.safe_load((root / "params.yaml").read_text())["midtrain"]


if __name__ == "__main__":
    main()
