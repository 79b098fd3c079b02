"""Post-training losses on linear_logprobs (GRPO; DPO, IPO, hinge, SimPO): the policy's logits never
exist whole."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fuseforge.ops.linear_cross_entropy import REDUCTIONS
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


PREFERENCE_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo")


def preference_loss(chosen_logprobs: Tensor, chosen_mask: Tensor, rejected_logprobs: Tensor, rejected_mask: Tensor, *,
                    ref_chosen_logps: Optional[Tensor] = None, ref_rejected_logps: Optional[Tensor] = None,
                    loss_type: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0, gamma: float = 0.5,
                    reduction: str = "mean", num_items_in_batch: Optional[float] = None) -> Tensor:
    """Pairwise preference losses from per-token log-probabilities, as TRL's DPOTrainer / CPOTrainer
    define them. chosen_logprobs, rejected_logprobs: (B, T) (linear_logprobs of each answer's tokens);
    the masks (B, T) mark answer tokens. A sequence's log-probability is the sum over its tokens
    (the mean, for "ipo" and "simpo").

      "sigmoid" (DPO): -(1 - ls) logsigmoid(beta z) - ls logsigmoid(-beta z),
                       z = (chosen - ref_chosen) - (rejected - ref_rejected);
      "ipo":           (z - 1 / (2 beta))^2, on mean log-probabilities (ref_* means too);
      "hinge":         relu(1 - beta z);
      "simpo":         the sigmoid form on z = mean chosen - mean rejected - gamma / beta, no reference.
    ref_chosen_logps, ref_rejected_logps: (B,) the reference model's, required by all but "simpo".
    reduction: "mean" over the pairs (num_items_in_batch instead of B when given: the accumulated
    batch's pair count, so micro-batches' gradients add up to the full batch's), "sum", or "none" (B,).
    """
    if loss_type not in PREFERENCE_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {PREFERENCE_LOSS_TYPES}, got {loss_type!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    for name, t, m in (("chosen", chosen_logprobs, chosen_mask), ("rejected", rejected_logprobs, rejected_mask)):
        if t.dim() != 2 or m.shape != t.shape:
            raise ValueError(f"{name}_logprobs and {name}_mask must both have shape (B, T), got {tuple(t.shape)} and "
                             f"{tuple(m.shape)}")
    if chosen_logprobs.shape[0] != rejected_logprobs.shape[0]:
        raise ValueError(f"chosen and rejected must have the same number of pairs, got {chosen_logprobs.shape[0]} "
                         f"and {rejected_logprobs.shape[0]}")
    needs_ref = loss_type != "simpo"
    if needs_ref and (ref_chosen_logps is None or ref_rejected_logps is None):
        raise ValueError(f"loss_type {loss_type!r} needs ref_chosen_logps and ref_rejected_logps")

    def sequence(logprobs, mask):
        mask = mask.to(logprobs.dtype)
        total = (logprobs * mask).sum(-1)
        return total / mask.sum(-1).clamp(min=1.0) if loss_type in ("ipo", "simpo") else total

    chosen, rejected = sequence(chosen_logprobs, chosen_mask), sequence(rejected_logprobs, rejected_mask)
    if needs_ref:
        z = (chosen - ref_chosen_logps.to(chosen.dtype)) - (rejected - ref_rejected_logps.to(chosen.dtype))
    else:
        z = chosen - rejected - gamma / beta
    if loss_type == "ipo":
        losses = (z - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * z)
    else:
        logsigmoid = torch.nn.functional.logsigmoid
        losses = -(1.0 - label_smoothing) * logsigmoid(beta * z) - label_smoothing * logsigmoid(-beta * z)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (losses.shape[0] if num_items_in_batch is None else float(num_items_in_batch))


class PreferenceLoss(torch.nn.Module):
    """DPO-family losses from the policy's last hidden states of chosen and rejected answers and its
    output head, without the logits: ``linear_logprobs`` of each answer's tokens, then
    ``preference_loss``. forward(chosen_hidden (B, T, H), rejected_hidden (B, T', H), weight (V, H),
    chosen_ids, rejected_ids, chosen_mask, rejected_mask, ref_chosen_logps=None,
    ref_rejected_logps=None, bias=None, num_items_in_batch=None) -> the loss."""

    def __init__(self, loss_type: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
                 gamma: float = 0.5, reduction: str = "mean"):
        super().__init__()
        if loss_type not in PREFERENCE_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {PREFERENCE_LOSS_TYPES}, got {loss_type!r}")
        self.loss_type, self.beta, self.label_smoothing = loss_type, float(beta), float(label_smoothing)
        self.gamma, self.reduction = float(gamma), reduction

    def forward(self, chosen_hidden: Tensor, rejected_hidden: Tensor, weight: Tensor, chosen_ids: Tensor,
                rejected_ids: Tensor, chosen_mask: Tensor, rejected_mask: Tensor,
                ref_chosen_logps: Optional[Tensor] = None, ref_rejected_logps: Optional[Tensor] = None,
                bias: Optional[Tensor] = None, num_items_in_batch: Optional[float] = None) -> Tensor:
        chosen = linear_logprobs(chosen_hidden, weight, chosen_ids, bias)
        rejected = linear_logprobs(rejected_hidden, weight, rejected_ids, bias)
        return preference_loss(chosen, chosen_mask, rejected, rejected_mask, ref_chosen_logps=ref_chosen_logps,
                               ref_rejected_logps=ref_rejected_logps, loss_type=self.loss_type, beta=self.beta,
                               label_smoothing=self.label_smoothing, gamma=self.gamma, reduction=self.reduction,
                               num_items_in_batch=num_items_in_batch)

    def extra_repr(self) -> str:
        return f"loss_type={self.loss_type!r}, beta={self.beta}, label_smoothing={self.label_smoothing}"
