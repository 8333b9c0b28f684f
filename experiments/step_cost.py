"""Where a decode's time goes, per decoder: the models' forwards against everything else, per token and per step.

The first N test re-ranking examples at batch 1, decoded in one run by our AR
loop (GR2, greedy, unconstrained: the benchmark's reference), by the block
diffusion decoder at one setting (`TAU:S:ETAU:ES`, as `decode_sweep.py`;
default the parity point, under the answer grammar as `evaluate` decodes), and
speculatively (GR2 verifying the diffusion model's window drafts, greedy). Each
model's `forward` is wrapped with a timer, so "model" is the time inside HF's
forward (Python included) and "rest" is the decoder's own work (masks, cache
bookkeeping, grammar, acceptance). A step is one forward of the diffusion
decoder, or one round (a draft, then its verification) of the speculative one.

The last lines turn those costs into what each speed goal needs: the tokens a
diffusion step must commit for 2x our AR loop, and the tokens a speculative
round must yield for 1.5x, at the step costs measured here.

    python experiments/step_cost.py --root WORKSPACE
    python experiments/step_cost.py --root WORKSPACE --setting 0.9:8:0.5:32 --draft-len 8 --runs 2
    python experiments/step_cost.py --root WORKSPACE --bf16-linears   # the diffusion model's linears in bf16

Set OMP_NUM_THREADS first (the pipeline runs with 2); only ratios measured in
one run mean anything on a shared CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gr2model.decoding.ar_decode import ar_generate
from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.eval.rerank_eval import decoder_kwargs, lm_rerank, speculative_kwargs
from tasks.evaluate import bench_inputs

sys.path.insert(0, str(Path(__file__).parent))
from decode_sweep import parse_setting  # noqa: E402  (a sibling script, not a package)


class ForwardTimer:
    """Wraps `model.forward` (the instance attribute) to add its wall time and calls to `seconds` / `calls`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds, self.calls = 0.0, 0
        inner = model.forward

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        model.forward = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


class _Bf16Linear(torch.nn.Module):
    """A linear layer with bf16 weights: (..., in) fp32 in, cast to bf16 for the matmul, (..., out) fp32 out."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight.detach().to(torch.bfloat16)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).float()


def bf16_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every `nn.Linear` of `model` by `_Bf16Linear`, in place (norms, attention, embeddings stay fp32)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, _Bf16Linear(child))
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="a workspace with checkpoints/gr2 and the diffusion checkpoint")
    p.add_argument("--checkpoint", default="checkpoints/dgr2", help="the diffusion model (decoder and drafter)")
    p.add_argument("--setting", default="0.9:8:0.9:32", help="the diffusion decoder's TAU:S:ETAU:ES[:cache]")
    p.add_argument("--draft-len", type=int, default=8, help="window drafts per speculative round")
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--bf16-linears", action="store_true", help="the diffusion model's linears in bf16 (not GR2's)")
    a = p.parse_args()
    fmt, items, lists = bench_inputs(a.root, a.examples)
    gr2, tok = load_hf_checkpoint(a.root / "checkpoints/gr2")
    model, _ = load_hf_checkpoint(a.root / a.checkpoint)
    if a.bf16_linears:
        bf16_linears(model)
    timers = {"gr2": ForwardTimer(gr2), "diffusion": ForwardTimer(model)}
    threshold, kw = parse_setting(a.setting)
    decoders = {
        "ar": (gr2, {"decoder": ar_generate}),
        "diffusion": (model, {**decoder_kwargs(model, threshold, **kw), "constrained": True}),
        "spec": (gr2, speculative_kwargs(model, 1, a.draft_len, "window")),
    }
    print(f"{torch.get_num_threads()} threads, {a.examples} test prompts, batch 1; diffusion {a.setting}, spec window {a.draft_len}")
    for run in range(a.runs):
        per_token: dict[str, float] = {}
        per_step: dict[str, tuple[float, float]] = {}
        for name, (m, kwargs) in decoders.items():
            for t in timers.values():
                t.reset()
            out = lm_rerank(m, tok, lists, items, fmt, desc=name, batch_size=1, max_new_tokens=320, **kwargs)
            model_s = sum(t.seconds for t in timers.values())
            calls = {k: t.calls for k, t in timers.items()}
            steps = sum(o.verifications for o in out.outputs) if name == "spec" else sum(t.calls for t in timers.values())
            n_tok = out.generated_tokens
            per_token[name] = out.seconds / n_tok
            per_step[name] = (out.seconds / steps, n_tok / steps)
            print(
                f"run {run} {name:9s} {1e3 * out.seconds / n_tok:.3f} ms/token (model {1e3 * model_s / n_tok:.3f}, "
                f"rest {1e3 * (out.seconds - model_s) / n_tok:.3f}); per step {1e3 * out.seconds / steps:.3f} ms "
                f"(model {1e3 * model_s / steps:.3f}: gr2 {calls['gr2'] / steps:.2f} and diffusion "
                f"{calls['diffusion'] / steps:.2f} forwards), {n_tok / steps:.2f} tokens per step",
                flush=True,
            )
        ar = per_token["ar"]
        for name, goal in (("diffusion", 2.0), ("spec", 1.5)):
            step_s, tokens = per_step[name]
            print(
                f"run {run} {name}: {ar / per_token[name]:.3f}x our AR loop; a step costs {step_s / ar:.2f} AR tokens' time, "
                f"so {goal}x needs {goal * step_s / ar:.2f} tokens per step (now {tokens:.2f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
