"""A small decoder-only transformer written twice: with fuseforge ops, and in plain PyTorch.

Both classes have the same architecture and the same parameter names, so one state dict fits both
and `reset_parameters(seed)` gives both the same weights:

- token + learned position embeddings, pre-LayerNorm blocks, a final LayerNorm and a tied head;
- attention: one fused qkv projection, grouped-query heads (n_kv_head divides n_head), causal;
  fuseforge: `fuseforge.ops.attention.attention`; PyTorch: `F.scaled_dot_product_attention`;
- MLP: an up-projection with a low-rank adapter (the LoRA shape) whose epilogue
  ``GELU(fc(x) + alpha * adapter_up(adapter_down(x)) + bias)`` is one `add_mul_act` in fuseforge and
  `F.gelu` over the sum in PyTorch, then a down-projection;
- head and loss: fuseforge: `linear_cross_entropy` (the logits are never materialised); PyTorch:
  `nn.Linear` + `F.cross_entropy` on float32 logits.

Mixed precision: both run under `torch.autocast`; the fuseforge modules cast their inputs to the
autocast dtype themselves, because custom ops are not cast by autocast.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fuseforge.nn.add_mul_act import AddMulActivation
from fuseforge.ops.add_mul_act import add_mul_act
from fuseforge.ops.attention import attention
from fuseforge.ops.linear_cross_entropy import linear_cross_entropy


@dataclass
class GPTConfig:
    vocab_size: int = 256          # byte-level tokens
    block_size: int = 128          # longest sequence (learned position embeddings)
    n_layer: int = 4
    n_head: int = 2
    n_kv_head: Optional[int] = None  # None: n_head (no grouped-query attention)
    d_model: int = 128
    mlp_ratio: int = 4
    adapter_rank: int = 8          # rank of the MLP up-projection's low-rank adapter
    adapter_alpha: float = 16.0    # the adapter's output is scaled by adapter_alpha / adapter_rank
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        if self.adapter_rank < 1:
            raise ValueError(f"adapter_rank must be >= 1, got {self.adapter_rank}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def hidden(self) -> int:
        return self.mlp_ratio * self.d_model

    @property
    def adapter_scale(self) -> float:
        return self.adapter_alpha / self.adapter_rank

    def to_dict(self) -> dict:
        return asdict(self)


def _autocast_dtype(t: Tensor) -> Optional[torch.dtype]:
    """The dtype autocast computes matmuls in on t's device, or None when autocast is off there."""
    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _cast(t: Tensor, dtype: Optional[torch.dtype]) -> Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


# ----------------------------------------------------------------------------------------------------------
# Modules shared by both models: the parameters live here, forward is in the subclasses.

class _Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.qkv = nn.Linear(c.d_model, (c.n_head + 2 * c.n_kv_head) * c.head_dim, bias=False)
        self.proj = nn.Linear(c.n_head * c.head_dim, c.d_model, bias=False)

    def split_heads(self, x: Tensor):
        """q (B, n_head, S, D), k and v (B, n_kv_head, S, D): strided views, last dim contiguous."""
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.n_head + 2 * self.n_kv_head, self.head_dim)
        q = qkv[:, :, :self.n_head].transpose(1, 2)
        k = qkv[:, :, self.n_head:self.n_head + self.n_kv_head].transpose(1, 2)
        v = qkv[:, :, self.n_head + self.n_kv_head:].transpose(1, 2)
        return q, k, v

    def merge_heads(self, y: Tensor) -> Tensor:
        b, _, s, _ = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, s, self.n_head * self.head_dim))


class TorchAddMulActivation(nn.Module):
    """``act(x + alpha * y + bias)`` in plain PyTorch: the same parameters as
    fuseforge.nn.AddMulActivation (a `bias` of shape (features,))."""

    def __init__(self, features: int, activation: str = "gelu", alpha: float = 1.0):
        super().__init__()
        if activation != "gelu":
            raise ValueError("only gelu is used here")
        self.features, self.activation, self.alpha = features, activation, float(alpha)
        self.bias = nn.Parameter(torch.zeros(features))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.gelu(x + self.alpha * y + self.bias)


class _MLP(nn.Module):
    def __init__(self, c: GPTConfig, act: nn.Module):
        super().__init__()
        self.fc = nn.Linear(c.d_model, c.hidden, bias=False)
        self.adapter_down = nn.Linear(c.d_model, c.adapter_rank, bias=False)
        self.adapter_up = nn.Linear(c.adapter_rank, c.hidden, bias=False)
        self.act = act  # holds the bias
        self.proj = nn.Linear(c.hidden, c.d_model, bias=False)


class _Block(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, d_model: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = attn
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = mlp

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _GPTBase(nn.Module):
    def __init__(self, config: GPTConfig, attn_cls, mlp_cls):
        super().__init__()
        c = self.config = config
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.block_size, c.d_model)
        self.blocks = nn.ModuleList(_Block(attn_cls(c), mlp_cls(c), c.d_model) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.head.weight = self.wte.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 style init from a CPU generator, parameter by parameter in name order, so that the
        same seed gives the same weights on any device, in both model classes."""
        g = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():  # tied weights appear once
            leaf = name.rsplit(".", 1)[-1]
            if ".ln_" in name or name.startswith("ln_"):
                value = torch.ones(p.shape) if leaf == "weight" else torch.zeros(p.shape)
            elif leaf == "bias":
                value = torch.zeros(p.shape)
            else:
                std = residual_std if name.endswith("proj.weight") else 0.02
                value = torch.randn(p.shape, generator=g) * std
            p.copy_(value)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx: Tensor) -> Tensor:
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} > block_size {self.config.block_size}")
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx: Tensor, targets: Optional[Tensor] = None) -> Tensor:
        """idx (B, S) int64. Returns the mean next-token loss when targets (B, S) are given,
        else the logits (B, S, vocab_size)."""
        x = self.embed(idx)
        if targets is None:
            return self.head(x)
        return self.loss(x, targets)


# ----------------------------------------------------------------------------------------------------------
# fuseforge

class FuseforgeAttention(_Attention):
    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.split_heads(x)
        dt = _autocast_dtype(x)
        y = attention(_cast(q, dt), _cast(k, dt), _cast(v, dt), causal=True)
        return self.merge_heads(y)


class FuseforgeMLP(_MLP):
    def __init__(self, c: GPTConfig):
        super().__init__(c, AddMulActivation(c.hidden, "gelu", alpha=c.adapter_scale))

    def forward(self, x: Tensor) -> Tensor:
        base, low_rank = self.fc(x), self.adapter_up(self.adapter_down(x))
        if base.dtype == self.act.bias.dtype:
            h = self.act(base, low_rank)
        else:  # under autocast the matmuls ran in bf16/fp16 and the bias is fp32
            h = add_mul_act(base, low_rank, self.act.bias.to(base.dtype), self.act.alpha, self.act.activation)
        return self.proj(h)


class FuseforgeGPT(_GPTBase):
    """The GPT with fuseforge attention, add_mul_act and linear_cross_entropy."""

    def __init__(self, config: GPTConfig):
        super().__init__(config, FuseforgeAttention, FuseforgeMLP)

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        dt = _autocast_dtype(x)
        h = _cast(x.reshape(-1, x.shape[-1]), dt)
        return linear_cross_entropy(h, _cast(self.head.weight, dt), targets.reshape(-1))


# ----------------------------------------------------------------------------------------------------------
# plain PyTorch

class TorchAttention(_Attention):
    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.split_heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.merge_heads(y)


class TorchMLP(_MLP):
    def __init__(self, c: GPTConfig):
        super().__init__(c, TorchAddMulActivation(c.hidden, "gelu", alpha=c.adapter_scale))

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x), self.adapter_up(self.adapter_down(x))))


class TorchGPT(_GPTBase):
    """The same GPT in plain PyTorch: SDPA, F.gelu, nn.Linear + F.cross_entropy."""

    def __init__(self, config: GPTConfig):
        super().__init__(config, TorchAttention, TorchMLP)

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        logits = self.head(x)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the usual upcast for a stable loss
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_pair(config: GPTConfig, seed: int = 0, device=None) -> tuple[FuseforgeGPT, TorchGPT]:
    """Both models, with identical weights (the same init, then the fuseforge model's state dict
    loaded into the PyTorch one)."""
    ff = FuseforgeGPT(config)
    ff.reset_parameters(seed)
    ref = TorchGPT(config)
    ref.load_state_dict(ff.state_dict())
    return ff.to(device), ref.to(device)
