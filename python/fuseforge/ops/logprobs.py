"""linear_logprobs: per-token log-probabilities of targets under a linear head, without the logits."""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

from fuseforge.ops.linear_cross_entropy import linear_cross_entropy, per_token_loss_and_entropy


def linear_logprobs(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                    temperature: float = 1.0, ignore_index: int = -100, softcap: Optional[float] = None,
                    return_entropy: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """``log_softmax((x @ weight.T + bias) / temperature)[..., target]`` per token, differentiable in x,
    weight and bias, without the (tokens x vocab) logits: the building block of policy-gradient losses
    (GRPO, PPO, RLOO) and of preference losses that sum a sequence's log-probabilities.

    It is ``-linear_cross_entropy(x / temperature, weight, target, bias / temperature,
    reduction="none")``: the fused loss's kernels (a chunked log-sum-exp on the GPU, float32
    arithmetic) with every token's gradient weighted by its own upstream gradient. With 16-bit inputs
    and a temperature other than 1, ``x / temperature`` is rounded to the input dtype once (about
    the rounding of eager 16-bit ``logits / temperature``; the log-probabilities are then within the
    dtype's epsilon, not float32's). ``softcap`` caps
    the logits first (``softcap * tanh(z / softcap)``, Gemma 2's final logits); it cannot be combined
    with a temperature other than 1 (the cap would apply to the tempered logits).

    Args:
        x: (..., H) float32, float16 or bfloat16 (float64 on the CPU).
        weight: (V, H), x's dtype.  bias: (V,) or None.
        target: (...) int64 or int32 token ids in [0, V), or ``ignore_index`` (log-probability 0, no
            gradient).
        temperature: a positive number; the logits are divided by it (sampling's temperature).
        return_entropy: also return each token's entropy ``-sum_j p_j log p_j`` of the same (tempered,
            capped) distribution, differentiable too (an entropy bonus or regulariser). It comes from
            the same pass over the logits (one more running sum beside the log-sum-exp); the backward
            takes the entropy's gradient in the same recomputation, and costs nothing more when the
            entropy gets none. Ignored tokens (``ignore_index``: prompt, padding) have entropy 0 and no
            gradient, as their log-probability; to get the entropy at a position without a target,
            give it any valid id there.
    Returns: float32 (float64 for float64 inputs) log-probabilities, target's shape; with
    ``return_entropy`` the tuple (log-probabilities, entropies), both of that shape and dtype.
    """
    temperature = float(temperature)
    if not temperature > 0.0:
        raise ValueError(f"temperature must be a positive number, got {temperature}")
    if softcap is not None and temperature != 1.0:
        raise ValueError("softcap and a temperature other than 1 cannot be combined: the cap would apply to the "
                         "tempered logits")
    if temperature != 1.0:
        x = x / temperature
        bias = bias / temperature if bias is not None else None
    if return_entropy:
        nll, entropy = per_token_loss_and_entropy(x, weight, target, bias, ignore_index=ignore_index, softcap=softcap)
        return -nll, entropy
    return -linear_cross_entropy(x, weight, target, bias, ignore_index=ignore_index, reduction="none",
                                 softcap=softcap)
