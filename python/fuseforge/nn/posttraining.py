"""Policy-gradient losses on linear_logprobs: the logits of the policy never exist whole."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fuseforge.ops.logprobs import linear_logprobs

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")


def grpo_loss(logprobs: Tensor, advantages: Tensor, mask: Tensor, *, old_logprobs: Optional[Tensor] = None,
              ref_logprobs: Optional[Tensor] = None, beta: float = 0.0, epsilon_low: float = 0.2,
              epsilon_high: Optional[float] = None, loss_type: str = "bnpo",
              num_items_in_batch: Optional[float] = None, max_completion_length: Optional[int] = None) -> Tensor:
    """GRPO's clipped surrogate loss from per-token log-probabilities, as TRL's GRPOTrainer defines it.

    logprobs: (B, T) the policy's log-probabilities of the sampled tokens (linear_logprobs).
    advantages: (B,) one advantage a completion.  mask: (B, T) 1 for completion tokens, 0 for padding.
    old_logprobs: (B, T) the sampling policy's (None: logprobs detached, one update per generation).
    ref_logprobs: (B, T) the reference model's, for the KL term beta * (exp(r - p) - (r - p) - 1)
        (the k3 estimator); required when beta != 0.
    Per token: ratio = exp(p - old), loss = -min(ratio * A, clip(ratio, 1 - epsilon_low,
    1 + epsilon_high) * A) + beta * kl. Then, by loss_type:
      "grpo": each completion's mean over its tokens, then the mean over completions;
      "bnpo": the sum over every completion token / their count (num_items_in_batch instead, when
              given: the whole accumulated batch's token count, so that micro-batches' gradients add
              up to the full batch's);
      "dr_grpo": the sum over every completion token / (B * max_completion_length) (T when not given).
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(f"logprobs and mask must both have shape (B, T), got {tuple(logprobs.shape)} and "
                         f"{tuple(mask.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must have shape (B,) = ({logprobs.shape[0]},), got {tuple(advantages.shape)}")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs (the reference model's log-probabilities)")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logprobs.dtype)
    old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    adv = advantages.to(logprobs.dtype)[:, None]
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if beta != 0.0:
        delta = ref_logprobs.to(logprobs.dtype) - logprobs
        per_token = per_token + beta * (torch.exp(delta) - delta - 1.0)
    per_token = per_token * mask
    if loss_type == "grpo":
        return (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        count = mask.sum().clamp(min=1.0) if num_items_in_batch is None else float(num_items_in_batch)
        return per_token.sum() / count
    length = logprobs.shape[1] if max_completion_length is None else int(max_completion_length)
    return per_token.sum() / (logprobs.shape[0] * length)


class GRPOLoss(torch.nn.Module):
    """GRPO's loss from the policy's last hidden states and its output head, without the logits:
    ``linear_logprobs`` of the completion tokens (at ``temperature``), then ``grpo_loss``.

    forward(hidden (B, T, H), weight (V, H), completion_ids (B, T), mask (B, T), advantages (B,),
    old_logprobs=None, ref_logprobs=None, bias=None, num_items_in_batch=None) -> the loss; hidden[:, t]
    is the state that predicts completion_ids[:, t]. (Per-token log-probabilities to log, or to keep
    as the next update's old_logprobs: ``fuseforge.linear_logprobs`` under no_grad.)
    """

    def __init__(self, beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: Optional[float] = None,
                 loss_type: str = "bnpo", temperature: float = 1.0, max_completion_length: Optional[int] = None):
        super().__init__()
        if loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
        self.beta, self.epsilon_low, self.epsilon_high = float(beta), float(epsilon_low), epsilon_high
        self.loss_type, self.temperature, self.max_completion_length = loss_type, float(temperature), \
            max_completion_length

    def forward(self, hidden: Tensor, weight: Tensor, completion_ids: Tensor, mask: Tensor, advantages: Tensor,
                old_logprobs: Optional[Tensor] = None, ref_logprobs: Optional[Tensor] = None,
                bias: Optional[Tensor] = None, num_items_in_batch: Optional[float] = None) -> Tensor:
        logprobs = linear_logprobs(hidden, weight, completion_ids, bias, temperature=self.temperature)
        return grpo_loss(logprobs, advantages, mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                         beta=self.beta, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                         loss_type=self.loss_type, num_items_in_batch=num_items_in_batch,
                         max_completion_length=self.max_completion_length)

    def extra_repr(self) -> str:
        return (f"beta={self.beta}, epsilon_low={self.epsilon_low}, epsilon_high={self.epsilon_high}, "
                f"loss_type={self.loss_type!r}, temperature={self.temperature}")
