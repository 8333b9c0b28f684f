"""Per-token KL divergences between two models' next-token distributions.

Shared by on-policy distillation (`gr2model.training.opd`, which also has the top-k
variant) and CFT's distillation term (`gr2model.training.cft`, `kd_weight`); kept apart
from both because `gr2model.training.opd` imports CFT's training layout through
`gr2model.training.diffusion_replay`.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["KLKind", "kl_terms", "token_kl"]

KLKind = Literal["forward", "reverse"]


def kl_terms(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum over the last dim of p (log p - log q), with 0 log 0 = 0 (no nan, no nan gradient)."""
    p = log_p.exp()
    live = p > 0
    # Sanitise both logs where p = 0: a -inf there would give nan through
    # (-inf) - (-inf), and torch.where does not stop a nan gradient.
    lp = torch.where(live, log_p, torch.zeros_like(log_p))
    lq = torch.where(live, log_q, torch.zeros_like(log_q))
    return (p * (lp - lq)).sum(-1)


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: KLKind = "forward") -> torch.Tensor:
    """Per-token KL between the teacher's and the student's full next-token distributions.

    Args:
        student_logits: (..., V) raw logits (gradients flow).
        teacher_logits: (..., V) raw logits or log-probs (only their softmax matters).
        kind: "forward" KL(teacher || student) or "reverse" KL(student || teacher).
    Returns:
        (...) float32, >= 0 (up to rounding), 0 where the distributions agree.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student {tuple(student_logits.shape)} vs teacher {tuple(teacher_logits.shape)}")
    log_s = torch.log_softmax(student_logits.float(), dim=-1)
    log_t = torch.log_softmax(teacher_logits.float(), dim=-1)
    if kind == "forward":
        return kl_terms(log_t, log_s)
    if kind == "reverse":
        return kl_terms(log_s, log_t)
    raise ValueError(f"kind must be 'forward' or 'reverse', got {kind!r}")
