"""Distillation losses on two linear heads (a student's and a teacher's), without either's logits."""
from __future__ import annotations

import math
from typing import Optional

from torch import Tensor, nn

from fuseforge.ops.linear_cross_entropy import REDUCTIONS
from fuseforge.ops.linear_jsd import linear_jsd


class LinearJSD(nn.Module):
    """The student's and the teacher's ``lm_head`` + a generalised JSD (or KL) distillation loss in one op.

    Before::

        s_logits = student.lm_head(student_hidden)           # (B, T, V) each: gigabytes
        with torch.no_grad():
            t_logits = teacher.lm_head(teacher_hidden)
        log_q = torch.log_softmax(s_logits.float() / T, -1)
        log_p = torch.log_softmax(t_logits.float() / T, -1)
        loss = ...                                           # the divergence of log_p and log_q

    After::

        loss_fn = fuseforge.nn.LinearJSD(beta=0.5, temperature=T)
        loss = loss_fn(student_hidden, student.lm_head.weight, teacher_hidden, teacher.lm_head.weight, labels)

    beta 0: forward KL(teacher || student); beta 1: reverse KL(student || teacher); in between, the
    generalised JSD (Liger-Kernel's convention). The module holds no parameters; the teacher gets no
    gradient. Settings as ``fuseforge.linear_jsd``.
    """

    def __init__(self, beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                 reduction: str = "mean"):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if not 0.0 <= float(beta) <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if not (math.isfinite(float(temperature)) and float(temperature) > 0.0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
        self.beta = float(beta)
        self.temperature = float(temperature)
        self.ignore_index = int(ignore_index)
        self.reduction = reduction

    def forward(self, student_x: Tensor, student_weight: Tensor, teacher_x: Tensor, teacher_weight: Tensor,
                target: Optional[Tensor] = None) -> Tensor:
        return linear_jsd(student_x, student_weight, teacher_x, teacher_weight, target, beta=self.beta,
                          temperature=self.temperature, ignore_index=self.ignore_index, reduction=self.reduction)

    def extra_repr(self) -> str:
        return (f"beta={self.beta}, temperature={self.temperature}, ignore_index={self.ignore_index}, "
                f"reduction={self.reduction!r}")
