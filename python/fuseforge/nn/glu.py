from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from fuseforge.ops.glu import ACTIVATIONS, glu


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


class GLU(nn.Module):
    """``act(gate) * up``, or ``act(g) * u`` of a fused ``[g | u]`` projection when ``up`` is None.

    Before::

        h = down_proj(F.silu(gate_proj(x)) * up_proj(x))

    After::

        h = down_proj(fuseforge.nn.GLU("silu")(gate_proj(x), up_proj(x)))
    """

    def __init__(self, activation: str = "silu"):
        super().__init__()
        _check_activation(activation)
        self.activation = activation

    def forward(self, gate: Tensor, up: Optional[Tensor] = None) -> Tensor:
        return glu(gate, up, self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class GatedMLP(nn.Module):
    """The gated MLP of Llama-family models, ``down_proj(act(gate_proj(x)) * up_proj(x))``, with the
    submodules named as Hugging Face's ``LlamaMLP`` (``gate_proj``, ``up_proj``, ``down_proj``), so its
    state_dict loads as is. activation: ``"silu"`` for Llama/Qwen/Mistral (``hidden_act="silu"``),
    ``"gelu_tanh"`` for Gemma (``gelu_pytorch_tanh``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        _check_activation(activation)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.activation))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
