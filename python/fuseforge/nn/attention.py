from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor, nn

from fuseforge.ops.attention import attention

LAYOUTS = ("bhsd", "bshd")


class Attention(nn.Module):
    """Scaled dot-product attention on the outputs of the q/k/v projections (no parameters).

    ``layout="bhsd"``: q (B, Hq, Sq, D), k and v (B, Hk, Sk, D), as
    ``F.scaled_dot_product_attention`` takes them; ``layout="bshd"``: (B, S, H, D) tensors straight
    from ``proj(x).view(B, S, H, D)``, read in place (no transpose copy) and the output returned as
    (B, Sq, Hq, D), ready for ``.reshape(B, Sq, Hq * D)``.

    Before::

        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in (wq(x), wk(x), wv(x)))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    After::

        attn = fuseforge.nn.Attention(causal=True, layout="bshd")
        o = attn(wq(x).view(B, S, Hq, D), wk(x).view(B, S, Hk, D), wv(x).view(B, S, Hk, D))
    """

    def __init__(self, causal: bool = False, scale: Optional[float] = None, layout: str = "bhsd",
                 deterministic: bool = False, window: Optional[Tuple[int, int]] = None,
                 softcap: Optional[float] = None):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.causal = bool(causal)
        self.scale = scale
        self.layout = layout
        self.deterministic = bool(deterministic)
        self.window = tuple(window) if window is not None else None
        self.softcap = softcap

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kw = dict(causal=self.causal, scale=self.scale, deterministic=self.deterministic, window=self.window,
                  softcap=self.softcap)
        if self.layout == "bshd":
            return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)
        return attention(q, k, v, **kw)

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, scale={self.scale}, layout={self.layout!r}, deterministic={self.deterministic}, "
                f"window={self.window}, softcap={self.softcap}")
