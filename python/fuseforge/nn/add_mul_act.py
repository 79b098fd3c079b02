from __future__ import annotations

import torch
from torch import Tensor, nn

from fuseforge.ops.add_mul_act import ACTIVATIONS, add_mul_act


class AddMulActivation(nn.Module):
    """``act(x + alpha * y + bias)`` with a learned bias: the epilogue of an MLP or LoRA layer.

    Before::

        h = F.gelu(base(x) + scale * lora_b(lora_a(x)) + bias)

    After (``base`` and ``lora_b`` without bias)::

        epilogue = fuseforge.nn.AddMulActivation(out_features, "gelu", alpha=scale)
        h = epilogue(base(x), lora_b(lora_a(x)))
    """

    def __init__(self, features: int, activation: str = "gelu", alpha: float = 1.0, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.features = features
        self.activation = activation
        self.alpha = float(alpha)
        self.bias = nn.Parameter(torch.zeros(features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return add_mul_act(x, y, self.bias, self.alpha, self.activation)

    def extra_repr(self) -> str:
        return f"{self.features}, activation={self.activation!r}, alpha={self.alpha}, bias={self.bias is not None}"
