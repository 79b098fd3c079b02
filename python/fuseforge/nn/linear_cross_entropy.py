from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from fuseforge.ops.linear_cross_entropy import REDUCTIONS, linear_cross_entropy


class LinearCrossEntropyLoss(nn.Module):
    """``lm_head`` + ``nn.CrossEntropyLoss`` in one op, without the (tokens x vocab) logits.

    Before::

        logits = lm_head(hidden)                      # (B, T, V): gigabytes for a large vocabulary
        loss = nn.CrossEntropyLoss()(logits.flatten(0, 1).float(), labels.flatten())

    After::

        loss_fn = fuseforge.nn.LinearCrossEntropyLoss()
        loss = loss_fn(hidden, lm_head.weight, labels, lm_head.bias)

    The module holds no parameters: the head's weight (and bias) are passed in, so a tied embedding
    works unchanged. Settings as ``fuseforge.linear_cross_entropy``.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: Optional[float] = None, low_memory: bool = False):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = float(label_smoothing)
        self.z_loss = float(z_loss)
        self.softcap = softcap
        self.low_memory = low_memory

    def forward(self, x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return linear_cross_entropy(x, weight, target, bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, label_smoothing=self.label_smoothing,
                                    z_loss=self.z_loss, softcap=self.softcap, low_memory=self.low_memory)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}, "
                f"low_memory={self.low_memory}")
