"""Stage `midtrain`: GR2's mid-training, the LM learns the items as vocabulary before SFT.

Builds the tokenizer (semantic-id, attribute, special, trace and mid-training
task words; or a local pretrained tokenizer extended with them) and the
Qwen3-style model (the size lives here, `midtrain.model`; or the local
pretrained `model.pretrained_path`, resized), trains it on next-item prediction
over semantic-id sequences, item <-> attributes, history -> recurring
attributes and the teacher's explanations (`gr2model.training.midtrain`), all from the
training parts of the sequences only, then measures next-item generative
retrieval (constrained beam search over the existing ids) on validation and
test. Saves `checkpoints/gr2-base`, where `sft` starts.

    python -m tasks.midtrain
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import polars as pl
import torch
from accelerate import Accelerator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gr2model.models.ar_model import ARModelConfig, build_ar_model, count_parameters
from gr2model.data.dataset import load_prepared
from gr2model.training.midtrain import (
    MIDTRAIN_WORDS,
    MidtrainTasks,
    NextItemEvalConfig,
    build_examples,
    encode_examples,
    explanation_of,
    next_item_eval,
)
from gr2model.training.sft import SFTConfig, sft_loss_sums, collate_right_padded, run_train_loop
from gr2model.teachers.teacher import TRACE_WORDS
from gr2model.task.tokenizer import build_tokenizer, extend_pretrained_tokenizer, special_ids
from tasks.common import Seed, StageConfig, StageResume, process_state, save_stage_checkpoint, stage_main, timed
from tasks.tracking import StageTracker
from tasks.traces import load_format

STAGE = "midtrain"
PREPARED = Path("data/prepared")
TRACES = Path("data/traces")
CHECKPOINT = Path("checkpoints/gr2-base")
METRICS = Path("metrics/midtrain.json")


class MidtrainConfig(StageConfig):
    seed: Seed = 0  # model initialisation
    # The library's configs are the params schema (unknown keys and bad values name the field).
    model: ARModelConfig = ARModelConfig(hidden_size=128, num_layers=2, intermediate_size=384)
    train: SFTConfig = SFTConfig(epochs=1, lr=2e-3)
    tasks: MidtrainTasks = MidtrainTasks()
    eval: NextItemEvalConfig = NextItemEvalConfig()
    # Batches of similar length (user sequences are 3 to 200 items): ~2.8x less padding on Beauty.
    group_by_length: bool = True


CONFIG = MidtrainConfig


def build_tokenizer_for(ds_items: pl.DataFrame, pretrained_path: str | None, max_evidence: int = 0) -> PreTrainedTokenizerBase:
    """Our word-level tokenizer, or the local pretrained one extended with the format's tokens.

    Words: the trace vocabulary and the mid-training task words; every later
    stage reads this tokenizer from the checkpoint. max_evidence: the prompt
    format's evidence features (their tokens join the vocabulary).
    """
    words = [*TRACE_WORDS, *MIDTRAIN_WORDS]
    if pretrained_path:
        return extend_pretrained_tokenizer(pretrained_path, ds_items, words, max_evidence=max_evidence)
    return build_tokenizer(ds_items, words, max_evidence=max_evidence)


def build_model_and_tokenizer(
    cfg: MidtrainConfig, ds_items: pl.DataFrame, max_evidence: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The tokenizer and the model of size `cfg.model` (or the pretrained one, resized to the tokenizer)."""
    tok = build_tokenizer_for(ds_items, cfg.model.pretrained_path, max_evidence)
    ids = special_ids(tok)
    model = build_ar_model(cfg.model, len(tok), pad_id=ids["pad"], bos_id=ids["bos"], eos_id=ids["eos"], seed=cfg.seed)
    return model, tok


def run(
    cfg: MidtrainConfig, root: Path, log: logging.Logger, tracker: StageTracker, resume: StageResume | None = None
) -> dict[str, Any]:
    """Mid-train from scratch (or a pretrained LM), evaluate next-item retrieval, save `checkpoints/gr2-base`."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    ds, split = load_prepared(root / PREPARED)
    explanations: list[str] = []
    if cfg.tasks.trace:
        # The re-ranking examples' explanations only: traces.unlabelled_lists would add up to
        # 111k more on Beauty, several times mid-training's cost for text of the same kind.
        traces = pl.read_parquet(root / TRACES / "train.parquet", columns=["response", "kept", "ranking", "target"])
        traces = traces.filter(pl.col("kept") & pl.col("ranking").list.contains(pl.col("target")))
        explanations = [e for e in map(explanation_of, traces["response"].to_list()) if e]

    with timed(log, "building the mid-training examples", timings, "build_s"):
        by_task = build_examples(split, ds.items, cfg.tasks, explanations)
        model, tok = build_model_and_tokenizer(cfg, ds.items, len(load_format(root).evidence))
        encoded: list[dict[str, list]] = []
        per_task: dict[str, dict[str, int]] = {}
        for task, examples in by_task.items():
            enc = encode_examples(tok, examples, cfg.train, progress=True)
            per_task[task] = {
                "examples": len(enc),
                "tokens": sum(len(e["input_ids"]) for e in enc),
                "loss_tokens": sum(sum(1 for w in e["weights"] if w > 0) for e in enc),
            }
            encoded += enc
    n_params = count_parameters(model)
    for task, counts in per_task.items():
        log.info("task %s: %d examples, %d tokens (%d with loss)", task, counts["examples"], counts["tokens"], counts["loss_tokens"])
    if not encoded:
        raise RuntimeError("midtrain: no example to train on (every task switched off or empty)")
    tokens_per_epoch = sum(c["tokens"] for c in per_task.values())
    log.info("model: %d parameters, vocabulary %d; %d examples, %d tokens per epoch", n_params, len(tok), len(encoded), tokens_per_epoch)

    scfg = cfg.train
    pad_id = tok.pad_token_id
    with timed(log, f"mid-training for {scfg.epochs} epochs", timings, "train_s"):
        model, history, steps = run_train_loop(
            model,
            encoded,
            functools.partial(collate_right_padded, pad_id=pad_id),
            lambda m, batch, epoch: sft_loss_sums(m, batch),
            scfg,
            accelerator=Accelerator(),
            on_step=tracker.log_step,
            desc="midtrain",
            lengths=[len(e["input_ids"]) for e in encoded] if cfg.group_by_length else None,
            checkpointer=resume.checkpointer() if resume else None,
        )
    # Every process evaluates (the same work, in the same wall time as one): a model FSDP
    # shards needs every process in each forward.
    model.to(process_state().device)
    retrieval: dict[str, dict[str, float]] = {}
    for which in ("valid", "test"):
        with timed(log, f"next-item retrieval on {which}", timings, f"eval_{which}_s"):
            retrieval[which] = next_item_eval(model, tok, split, ds.items, which, cfg.eval, cfg.tasks.max_items)
        log.info("next-item %s: %s", which, {k: round(v, 4) for k, v in retrieval[which].items()})
    save_stage_checkpoint(root / CHECKPOINT, model, tok, {"stage": STAGE, **cfg.model_dump()})

    steps_metrics = [h for h in history if "loss" in h]
    tail = steps_metrics[-50:]  # one batch's loss is noisy: the mean of the last (up to) 50 steps

    def tail_mean(key: str) -> float | None:
        return round(sum(h[key] for h in tail) / len(tail), 4) if tail else None

    # The loop's reasoning/answer split is next-item vs the other tasks here (`encode_examples`).
    return {
        "parameters": n_params,
        "vocab_size": len(tok),
        "examples": {t: c["examples"] for t, c in per_task.items()},
        "tokens": {t: c["tokens"] for t, c in per_task.items()},
        "loss_tokens": {t: c["loss_tokens"] for t, c in per_task.items()},
        "tokens_per_epoch": tokens_per_epoch,
        "steps": steps,
        "first_train_loss": steps_metrics[0]["loss"] if steps_metrics else None,
        "final_train_loss": tail_mean("loss"),
        "final_sequence_loss": tail_mean("reasoning_loss"),
        "final_grounding_loss": tail_mean("answer_loss"),
        "retrieval": retrieval,
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS, resumable=True, distributed=True)


if __name__ == "__main__":
    main()
