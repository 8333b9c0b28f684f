"""The GPU check of the decoders, as one prepared script for a lent GPU machine (device tool).

Two parts, each writing its numbers to $OUT/gpu_check.json as soon as it ends
(one failing part does not lose the other's):

  a: the default profile's real models (GR2, and the diffusion checkpoints
     exported next to it) through `gr2model.eval.bench.decode_benchmark` on the GPU:
     tokens/s, tokens per forward and forward cost of AR, diffusion (tau 0.9 and
     0.7, whole block and sub-blocks of 8) and speculative rows, batch 1 and 16.
     It measures what the CPU benchmark's `projected_speedup` only assumes: that
     on a GPU a block forward costs about what a one-token forward costs.
  b: Qwen3-0.6B- and 1.7B-shaped models (random weights, bf16, sdpa): the cost
     of a forward over 1, 4, 8, 16 and 32 new positions after a 1,024-token
     cached prompt, in one-token forwards, at batch 1 and 16 (the paper-scale
     forward cost), and one SFT step of the 0.6B shape (AdamW, bf16 autocast,
     batch 8 x 1,024): seconds, tokens/s and peak memory.

Needs only gr2model, torch, transformers and polars (no MLflow, Prefect or DVC),
so it runs on the device image with polars carried as wheels. Export the data
and checkpoints on this machine first:

    python experiments/gpu_check.py export WORKSPACE .gpu/data gr2 dgr2-cft dgr2

then, on the device (from the repository root, `.gpu` and the polars wheels carried):

    python experiments/gpu_check.py ab 64        # parts, test examples for part a

On a machine without CUDA it runs the same code on the CPU with part b's
shapes shrunk to 2 layers (a check that the script works, not a measurement).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("gpu_check")
DATA = Path(".gpu/data")
SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8),
}


def export(ws: Path, out: Path, models: list[str]) -> None:
    """Write the test re-ranking examples, items, prompt format and `models`' checkpoints of workspace `ws` to `out`."""
    from gr2model.data.dataset import load_prepared
    from gr2model.eval.rerank_eval import rerank_examples
    from tasks.traces import load_format, load_lists

    out.mkdir(parents=True, exist_ok=True)
    ds, _ = load_prepared(ws / "data/prepared")
    ds.items.write_parquet(out / "items.parquet")
    rerank_examples(load_lists(ws, "test")).write_parquet(out / "test.parquet")
    (out / "format.json").write_text(json.dumps(dataclasses.asdict(load_format(ws))))
    for m in models:
        shutil.copytree(ws / "checkpoints" / m, out / m, dirs_exist_ok=True)
    print("exported", sorted(p.name for p in out.iterdir()))


def part_a(res: dict[str, Any], dev: str, n_examples: int, out: Path) -> None:
    """The real models' decode benchmark on `dev` (module docstring, part a)."""
    from gr2model.eval.bench import decode_benchmark, speed_table
    from gr2model.models.checkpoint import load_hf_checkpoint
    from gr2model.task.rerank_format import FormatConfig, ItemText

    items = ItemText(pl.read_parquet(DATA / "items.parquet"))
    fmt = FormatConfig(**json.loads((DATA / "format.json").read_text()))
    lists = pl.read_parquet(DATA / "test.parquet").head(n_examples)
    gr2, tok = load_hf_checkpoint(DATA / "gr2")
    gr2 = gr2.to(dev).eval()
    models = {m: load_hf_checkpoint(DATA / m)[0].to(dev).eval() for m in ("dgr2-cft", "dgr2") if (DATA / m).exists()}
    drafter = next(iter(models.items()), None)
    drafters = dict([drafter]) if drafter else {}
    kw: dict[str, Any] = dict(max_new_tokens=320, sub_block_sizes=(8,), drafters=drafters, draft_len=8, draft_steps=2)
    # Warm-up on 8 examples: CUDA context, kernels and allocator before any timed row.
    decode_benchmark(gr2, models, tok, lists.head(8), items, fmt, taus=[0.9], batch_sizes=[1], **kw)
    t = time.time()

    def on_row(r: dict[str, Any]) -> None:
        log.info("%s %s tau=%s s=%s b%d: %.0f tok/s, %.2fx, %.2f tokens/forward, forward cost %.2f, valid %.3f",
                 r["decoder"], r["model"], r["tau"], r.get("sub_block_size"), r["batch_size"], r["tokens_per_s"],
                 r["speedup"], r["tokens_per_forward"], r["forward_cost"], r["valid_format_rate"])  # fmt: skip

    rows = decode_benchmark(gr2, models, tok, lists, items, fmt, taus=[0.9, 0.7], batch_sizes=[1, 16], on_row=on_row, **kw)
    res["part_a"] = {"examples": lists.height, "seconds": time.time() - t, "rows": rows}
    (out / "speed_gpu.md").write_text(speed_table(rows) + "\n")


def _median_seconds(fn: Callable[[], None], dev: str, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def part_b(res: dict[str, Any], dev: str) -> None:
    """Paper-scale forward costs and one SFT step (module docstring, part b)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.cache_utils import DynamicCache

    small = dev != "cuda"
    prompt = 128 if small else 1024
    res["part_b"] = {}
    for name, shape in SHAPES.items():
        if small:
            shape = dict(shape, num_hidden_layers=2, hidden_size=256, intermediate_size=512)
        cfg = Qwen3Config(vocab_size=151936, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True, **shape)
        torch.manual_seed(0)
        with torch.device(dev):  # initialise where it runs: a CPU init of 1.7B weights takes most of a minute
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
        r: dict[str, Any] = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6}
        for bs in (1, 16):
            with torch.no_grad():
                cache = DynamicCache(config=cfg)
                prefill = torch.randint(0, 150000, (bs, prompt), device=dev)
                model(input_ids=prefill, past_key_values=cache, use_cache=True, logits_to_keep=1)  # not (bs, 1024, 152k) logits

                def step(width: int) -> None:
                    x = torch.randint(0, 150000, (bs, width), device=dev)
                    model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=width)
                    cache.crop(-width)  # negative: drop what was just added (the same in transformers 5.17 and 5.24)

                cost = {w: _median_seconds(lambda w=w: step(w), dev) for w in (1, 4, 8, 16, 32)}
            r[f"b{bs}_ms"] = {w: 1e3 * c for w, c in cost.items()}
            r[f"b{bs}_cost_in_token_forwards"] = {w: c / cost[1] for w, c in cost.items()}
            log.info("%s b%d: forward ms by new positions %s", name, bs, {w: round(1e3 * c, 3) for w, c in cost.items()})
        del model
        if name == "qwen3-0.6b":
            with torch.device(dev):
                model = Qwen3ForCausalLM(cfg).train()  # fp32 master weights, bf16 autocast: accelerate's mixed_precision bf16
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")
            b, length = (2, 128) if small else (8, 1024)
            x = torch.randint(0, 150000, (b, length), device=dev)
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()

            def train_step() -> None:
                with torch.autocast(dev, dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            s = _median_seconds(train_step, dev, reps=8)
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None
            r["sft_step"] = {"batch": b, "seq": length, "seconds": s, "tokens_per_s": b * length / s, "peak_gib": peak}
            log.info("%s SFT step: %s", name, r["sft_step"])
            del model, opt
        if dev == "cuda":
            torch.cuda.empty_cache()
        res["part_b"][name] = r


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if sys.argv[1] == "export":
        export(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
        return
    parts, n_examples = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64
    out = Path(os.environ.get("OUT", "gpu_check_out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__}
    for name, run in (("a", lambda: part_a(res, dev, n_examples, out)), ("b", lambda: part_b(res, dev))):
        if name in parts:
            try:
                run()
            except Exception as e:  # one part failing must not lose the other's numbers
                traceback.print_exc()
                res[f"part_{name}_error"] = repr(e)
            (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k != "part_a"}, indent=1, default=str))


if __name__ == "__main__":
    main()
