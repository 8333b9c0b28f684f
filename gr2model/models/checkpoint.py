"""Hugging Face checkpoint folders: weights, config, tokenizer, the resolved stage config, a marker written last.

A folder without the marker is a half-written one (a crash mid-save) and is
never loaded. Folders load with the `Auto*` classes; nothing here is specific to
one stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

MARKER = "COMPLETE"
STAGE_CONFIG = "stage_config.json"


def save_hf_checkpoint(
    out_dir: Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    stage_config: dict[str, Any],
    state_dict: dict[str, Any] | None = None,
) -> None:
    """Write model, tokenizer and the stage config into `out_dir`, the marker last.

    The caller makes the folder atomic (write to a temporary name, then rename).
    state_dict: the weights to write when the model's own are sharded between
    processes (FSDP: gathered by the caller); None writes `model`'s.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, state_dict=state_dict)
    tokenizer.save_pretrained(out_dir)
    (out_dir / STAGE_CONFIG).write_text(json.dumps(stage_config, indent=2, default=str))
    (out_dir / MARKER).write_text("ok\n")


def load_hf_checkpoint(ckpt_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (eval mode) and tokenizer of a complete checkpoint folder."""
    if not (ckpt_dir / MARKER).exists():
        raise FileNotFoundError(f"{ckpt_dir}: not a complete checkpoint (no {MARKER} marker); rerun the stage that writes it")
    model = AutoModelForCausalLM.from_pretrained(ckpt_dir)
    model.eval()
    return model, AutoTokenizer.from_pretrained(ckpt_dir)


def read_stage_config(ckpt_dir: Path) -> dict[str, Any]:
    """The resolved config of the stage that wrote the checkpoint."""
    return json.loads((ckpt_dir / STAGE_CONFIG).read_text())
