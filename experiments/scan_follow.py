"""Does a GR2 trained on scan reasoning (`traces.reasoning: scan`) rank what its scan picked?

Decodes every re-ranking example of a split with a checkpoint (greedy, no grammar, the
call `evaluate` makes) and reads its own step 2 back: per valid answer, whether its first
item is the scan's last pick; per scan step, whether the evidence levels it wrote are the
prompt's (and the teacher agreement of lists copied right against lists with a miscopied
step); and how often the last pick (and the answer's first item) is the teacher's
first choice, beside the same figures for the incoming order.

    python experiments/scan_follow.py --root WORKSPACE checkpoints/gr2
    python experiments/scan_follow.py --root WORKSPACE --split valid --max-examples 300 checkpoints/gr2

Prints one JSON line per checkpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from gr2model.data.dataset import load_prepared
from gr2model.eval.rerank_eval import lm_rerank, rerank_examples
from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.task.rerank_format import ItemText
from tasks.evaluate import load_teacher, teacher_rankings
from tasks.traces import load_format, load_lists

_STEP = re.compile(r"<pos_(\d+)> ((?:<ev\d+_\d+> )+)pick <pos_(\d+)> ((?:<ev\d+_\d+> ?)+)")


def scan_steps(explanation: str) -> list[tuple[int, list[str], int, list[str]]]:
    """(scanned position, its written levels, picked position, the pick's written levels) per step of step 2."""
    body = explanation.split(" step 2 : ", 1)[-1].split(" step 3 : ", 1)[0]
    return [(int(a), ea.split(), int(b), eb.split()) for a, ea, b, eb in _STEP.findall(body)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--split", default="test")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-examples", type=int, default=0)
    a = p.parse_args()
    ds, split = load_prepared(a.root / "data/prepared")
    items = ItemText(ds.items)
    fmt = load_format(a.root)
    lists = rerank_examples(load_lists(a.root, a.split))
    lists = lists.head(a.max_examples) if a.max_examples else lists
    teacher = load_teacher(a.root, ds.items, split["train"].to_list(), ds.num_items)
    teacher_first = [r[0] for r in teacher_rankings(teacher, lists)]
    cands = lists["candidates"].to_list()
    evidence = lists["evidence"].to_list()
    for ckpt in a.checkpoints:
        model, tok = load_hf_checkpoint(a.root / ckpt)
        t0 = time.perf_counter()
        out = lm_rerank(model.eval(), tok, lists, items, fmt, batch_size=a.batch_size, desc=f"{ckpt} {a.split}")
        follows = scanned = steps_ok = levels_ok = levels_n = pick_teacher = first_teacher = 0
        exact = [0, 0]  # lists whose every step copied the prompt's levels: [count, of them with the teacher's pick]
        miscopied = [0, 0]
        for parsed, cs, ev, tf in zip(out.parsed, cands, evidence, teacher_first, strict=True):
            first_teacher += parsed.ranking[0] == tf
            steps = scan_steps(parsed.explanation or "")
            if not steps or not parsed.valid_permutation:
                continue
            scanned += 1
            last = steps[-1][2]
            follows += 1 <= last <= len(cs) and parsed.ranking[0] == cs[last - 1]
            picks_teachers = 1 <= last <= len(cs) and cs[last - 1] == tf
            pick_teacher += picks_teachers
            steps_ok += [s[0] for s in steps] == list(range(1, len(cs) + 1))
            right = 0
            for pos, written, _, _ in steps:
                if 1 <= pos <= len(cs):
                    want = [f"<ev{f + 1}_{lvl}>" for f, lvl in enumerate(ev[pos - 1])]
                    right += written == want
                    levels_n += 1
            levels_ok += right
            bucket = exact if right == len(steps) else miscopied
            bucket[0] += 1
            bucket[1] += picks_teachers
        n = len(out.parsed)
        print(json.dumps({
            "checkpoint": ckpt, "split": a.split, "n": n,
            "valid_with_scan": scanned / n,
            "first_is_last_pick": follows / max(scanned, 1),
            "scan_visits_every_candidate_in_order": steps_ok / max(scanned, 1),
            "levels_copied_right": levels_ok / max(levels_n, 1),
            "last_pick_is_teachers_first": pick_teacher / max(scanned, 1),
            "every_step_copied_right": exact[0] / max(scanned, 1),
            "last_pick_is_teachers_first_if_every_step_copied_right": exact[1] / max(exact[0], 1),
            "last_pick_is_teachers_first_if_a_step_miscopied": miscopied[1] / max(miscopied[0], 1),
            "first_is_teachers_first": first_teacher / n,
            "incoming_first_is_teachers_first": sum(c[0] == t for c, t in zip(cands, teacher_first, strict=True)) / n,
            "seconds": round(time.perf_counter() - t0, 1),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
