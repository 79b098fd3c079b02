"""Post-training losses on linear_logprobs: the policy's logits never exist whole.

GRPO (grpo_loss, GRPOLoss); paired preferences with a reference model, DPO / IPO / hinge, and SimPO
(preference_loss, PreferenceLoss); reference-free CPO and ORPO with their NLL term (cpo_loss, CPOLoss,
orpo_loss, ORPOLoss); unpaired KTO (kto_loss, KTOLoss, kto_kl). The functional losses take per-token
log-probabilities (fuseforge.linear_logprobs); the modules take the last hidden states and the output
head. On CUDA, with a reduced loss ("mean" / "sum"), a gradient wanted and bf16 / float32 inputs, the
preference modules (PreferenceLoss, CPOLoss, ORPOLoss, KTOLoss) work on chunks of whole pairs
(completions) and form the gradients in the forward (fuseforge.ops.logprobs.sequence_chunked_loss:
three matrix products, the chunk's logits in the input dtype); otherwise (the CPU, whose fused
per-token kernels are faster there; traced by torch.compile) they take linear_logprobs of every
token. Examples: examples/grpo.py, examples/dpo.py."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor

from fuseforge.ops.linear_cross_entropy import REDUCTIONS
from fuseforge.ops.logprobs import linear_logprobs, sequence_chunked_loss, sequence_loss_chunkable

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
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _check_pairs(chosen_logprobs: Tensor, chosen_mask: Tensor, rejected_logprobs: Tensor,
                 rejected_mask: Tensor) -> None:
    for name, t, m in (("chosen", chosen_logprobs, chosen_mask), ("rejected", rejected_logprobs, rejected_mask)):
        if t.dim() != 2 or m.shape != t.shape:
            raise ValueError(f"{name}_logprobs and {name}_mask must both have shape (B, T), got {tuple(t.shape)} and "
                             f"{tuple(m.shape)}")
    if chosen_logprobs.shape[0] != rejected_logprobs.shape[0]:
        raise ValueError(f"chosen and rejected must have the same number of pairs, got {chosen_logprobs.shape[0]} "
                         f"and {rejected_logprobs.shape[0]}")


def _sequence(logprobs: Tensor, mask: Tensor, average: bool) -> Tensor:
    """A sequence's log-probability: the sum over its tokens, or their mean."""
    mask = mask.to(logprobs.dtype)
    total = (logprobs * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1.0) if average else total


def _margin_loss(z: Tensor, loss_type: str, beta: float, label_smoothing: float) -> Tensor:
    """The per-pair loss of a margin z: IPO's square, the hinge, or the (label-smoothed) sigmoid form."""
    if loss_type == "ipo":
        return (z - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * z)
    logsigmoid = torch.nn.functional.logsigmoid
    return -(1.0 - label_smoothing) * logsigmoid(beta * z) - label_smoothing * logsigmoid(-beta * z)


def _number(count: Union[float, Tensor]) -> Union[float, Tensor]:
    """A count as a float, or a tensor as it is (a device count: no host sync)."""
    return count if isinstance(count, Tensor) else float(count)


def _reduce(losses: Tensor, reduction: str, count: Optional[float]) -> Tensor:
    """The losses as they are ("none"), their sum ("sum"), or their sum over count ("mean"; the batch size
    when count is None)."""
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (losses.shape[0] if count is None else _number(count))


def _with_chosen_nll(pair_losses: Tensor, chosen_logprobs: Tensor, chosen_mask: Tensor, weight: float,
                     reduction: str, num_items_in_batch: Optional[float], num_chosen_tokens: Optional[float]) -> Tensor:
    """A pair term plus weight x the negative log-likelihood of the chosen answers' tokens (ORPO, CPO).
    "mean" divides the pair term by the pair count and the NLL by the chosen token count, as TRL's
    trainers do (its mean cross-entropy over the chosen tokens); "none" gives each pair its term plus
    weight x its own chosen tokens' summed NLL, and "sum" sums that."""
    if weight == 0.0:
        return _reduce(pair_losses, reduction, num_items_in_batch)
    mask = chosen_mask.to(chosen_logprobs.dtype)
    nll = -(chosen_logprobs * mask).sum(-1)
    if reduction == "none":
        return pair_losses + weight * nll
    if reduction == "sum":
        return pair_losses.sum() + weight * nll.sum()
    tokens = mask.sum().clamp(min=1.0) if num_chosen_tokens is None else _number(num_chosen_tokens)
    return _reduce(pair_losses, "mean", num_items_in_batch) + weight * nll.sum() / tokens


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
    Reference-free variants with an NLL term: cpo_loss, orpo_loss.
    """
    if loss_type not in PREFERENCE_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {PREFERENCE_LOSS_TYPES}, got {loss_type!r}")
    _check_reduction(reduction)
    _check_pairs(chosen_logprobs, chosen_mask, rejected_logprobs, rejected_mask)
    needs_ref = loss_type != "simpo"
    if needs_ref and (ref_chosen_logps is None or ref_rejected_logps is None):
        raise ValueError(f"loss_type {loss_type!r} needs ref_chosen_logps and ref_rejected_logps")
    average = loss_type in ("ipo", "simpo")
    chosen = _sequence(chosen_logprobs, chosen_mask, average)
    rejected = _sequence(rejected_logprobs, rejected_mask, average)
    if needs_ref:
        z = (chosen - ref_chosen_logps.to(chosen.dtype)) - (rejected - ref_rejected_logps.to(chosen.dtype))
    else:
        z = chosen - rejected - gamma / beta
    return _reduce(_margin_loss(z, loss_type, beta, label_smoothing), reduction, num_items_in_batch)


def cpo_loss(chosen_logprobs: Tensor, chosen_mask: Tensor, rejected_logprobs: Tensor, rejected_mask: Tensor, *,
             loss_type: str = "sigmoid", beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
             gamma: float = 0.5, reduction: str = "mean", num_items_in_batch: Optional[float] = None,
             num_chosen_tokens: Optional[float] = None) -> Tensor:
    """CPO (Contrastive Preference Optimization) as TRL's CPOTrainer and Liger's
    LigerFusedLinearCPOLoss define it: preference_loss's forms without a reference model, plus alpha x
    the negative log-likelihood of the chosen answers (behaviour cloning).

      z = chosen - rejected (sums over tokens; means for "ipo" and "simpo", and "simpo" subtracts
      gamma / beta), then "sigmoid" -(1 - ls) logsigmoid(beta z) - ls logsigmoid(-beta z), "hinge"
      relu(1 - beta z), "ipo" (z - 1 / (2 beta))^2; loss = pair term + alpha x NLL(chosen).
    alpha = 0 and loss_type "simpo" is SimPO. reduction "mean": the pair term over the pairs
    (num_items_in_batch when given) plus alpha x the NLL summed over the chosen tokens over their count
    (num_chosen_tokens when given: the accumulated batch's, so micro-batches add up to the full
    batch); "none": (B,) each pair's term plus alpha x its chosen tokens' summed NLL; "sum": their sum.
    """
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {CPO_LOSS_TYPES}, got {loss_type!r}")
    _check_reduction(reduction)
    _check_pairs(chosen_logprobs, chosen_mask, rejected_logprobs, rejected_mask)
    average = loss_type in ("ipo", "simpo")
    z = _sequence(chosen_logprobs, chosen_mask, average) - _sequence(rejected_logprobs, rejected_mask, average)
    if loss_type == "simpo":
        z = z - gamma / beta
    pair = _margin_loss(z, loss_type, beta, label_smoothing)
    return _with_chosen_nll(pair, chosen_logprobs, chosen_mask, float(alpha), reduction, num_items_in_batch,
                            num_chosen_tokens)


def orpo_loss(chosen_logprobs: Tensor, chosen_mask: Tensor, rejected_logprobs: Tensor, rejected_mask: Tensor, *,
              beta: float = 0.1, reduction: str = "mean", num_items_in_batch: Optional[float] = None,
              num_chosen_tokens: Optional[float] = None) -> Tensor:
    """ORPO (Odds Ratio Preference Optimization) as TRL's ORPOTrainer and Liger's
    LigerFusedLinearORPOLoss define it: the NLL of the chosen answers plus
    -beta logsigmoid(log odds(chosen) - log odds(rejected)), odds(y) = p / (1 - p) with log p the
    mean of y's token log-probabilities. No reference model. log(1 - p) is log(-expm1(log p)), exact
    where p is near 1. reduction as cpo_loss's (the NLL's weight is 1)."""
    _check_reduction(reduction)
    _check_pairs(chosen_logprobs, chosen_mask, rejected_logprobs, rejected_mask)
    chosen = _sequence(chosen_logprobs, chosen_mask, True)
    rejected = _sequence(rejected_logprobs, rejected_mask, True)
    log_odds = (chosen - rejected) - (torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected)))
    pair = -beta * torch.nn.functional.logsigmoid(log_odds)
    return _with_chosen_nll(pair, chosen_logprobs, chosen_mask, 1.0, reduction, num_items_in_batch,
                            num_chosen_tokens)


def kto_kl(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's reference point, as TRL's KTOTrainer estimates it: the mean over a batch of mismatched
    (prompt, completion) pairs of the policy's minus the reference's sequence log-probabilities,
    clamped at 0 and detached (the baseline carries no gradient). (B,) each, sums over tokens, computed
    under no_grad (fuseforge.linear_logprobs)."""
    if policy_kl_logps.shape != ref_kl_logps.shape or policy_kl_logps.dim() != 1:
        raise ValueError(f"policy_kl_logps and ref_kl_logps must both have shape (B,), got "
                         f"{tuple(policy_kl_logps.shape)} and {tuple(ref_kl_logps.shape)}")
    return (policy_kl_logps.detach() - ref_kl_logps.to(policy_kl_logps.dtype)).mean().clamp(min=0.0)


def kto_loss(logprobs: Tensor, mask: Tensor, desirable: Tensor, ref_logps: Tensor, *,
             kl: Optional[Union[Tensor, float]] = None, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0, reduction: str = "mean",
             num_items_in_batch: Optional[float] = None) -> Tensor:
    """KTO (Kahneman-Tversky Optimization) on unpaired completions, as TRL's KTOTrainer defines it
    (Liger's LigerFusedLinearKTOLoss with weights 1). logprobs (B, T) of each completion's tokens, mask
    (B, T) its tokens, desirable (B,) bool (True: a good completion), ref_logps (B,) the reference
    model's sequence log-probabilities (sums over tokens, as the policy's). With r = sum(logprobs) -
    ref_logps and kl the reference point (kto_kl; None: 0, TRL's calculate_KL=False; detached):
      desirable:   desirable_weight   x (1 - sigmoid(beta (r - kl)));
      undesirable: undesirable_weight x (1 - sigmoid(beta (kl - r))).
    reduction: "mean" over the completions (num_items_in_batch when given: the accumulated batch's
    completion count), "sum", or "none" (B,).
    """
    _check_reduction(reduction)
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(f"logprobs and mask must both have shape (B, T), got {tuple(logprobs.shape)} and "
                         f"{tuple(mask.shape)}")
    batch = logprobs.shape[:1]
    if desirable.shape != batch or desirable.dtype != torch.bool:
        raise ValueError(f"desirable must be a bool tensor of shape (B,) = ({batch[0]},), got {desirable.dtype} "
                         f"{tuple(desirable.shape)}")
    if ref_logps.shape != batch:
        raise ValueError(f"ref_logps must have shape (B,) = ({batch[0]},), got {tuple(ref_logps.shape)}")
    r = _sequence(logprobs, mask, False) - ref_logps.to(logprobs.dtype)
    if kl is None:
        kl = 0.0
    elif isinstance(kl, Tensor):
        if kl.numel() != 1:
            raise ValueError(f"kl must be a scalar (kto_kl's reference point), got shape {tuple(kl.shape)}")
        kl = kl.detach().to(logprobs.dtype).reshape(())
    losses = torch.where(desirable, float(desirable_weight) * (1.0 - torch.sigmoid(beta * (r - kl))),
                         float(undesirable_weight) * (1.0 - torch.sigmoid(beta * (kl - r))))
    return _reduce(losses, reduction, num_items_in_batch)


def _group_count(hidden: Tensor, num_items_in_batch) -> Union[int, float, Tensor]:
    """The whole batch's pair (completion) count, a "mean" normaliser fixed before the batch is cut into
    chunks: num_items_in_batch when given, else hidden's batch size."""
    return hidden.shape[0] if num_items_in_batch is None else num_items_in_batch


def _batch_counts(chosen_hidden: Tensor, chosen_mask: Tensor, num_items_in_batch, num_chosen_tokens) -> tuple:
    """The whole batch's pair count and chosen-token count (a device tensor: no host sync), the "mean"
    normalisers of CPO and ORPO, fixed before the batch is cut into chunks."""
    pairs = _group_count(chosen_hidden, num_items_in_batch)
    if num_chosen_tokens is None:
        num_chosen_tokens = chosen_mask.sum().clamp(min=1.0).to(torch.float32)
    return pairs, num_chosen_tokens


def _slice(t: Optional[Tensor], sl: slice) -> Optional[Tensor]:
    return None if t is None else t[sl]


def _sequence_loss(hiddens: tuple, ids: tuple, weight: Tensor, bias: Optional[Tensor], reduction: str,
                   loss: Callable[[list, slice], Tensor]) -> Tensor:
    """loss(log-probabilities of each stream's tokens, the groups they cover) for the whole batch. A
    reduced loss that wants gradients in plain eager mode takes sequence_chunked_loss (the gradients in
    the forward, three matrix products; loss then gets chunks of groups, its normalisers being the
    whole batch's); otherwise linear_logprobs of every token (per-token gradients in the backward)."""
    if (reduction != "none" and all(h.dim() == 3 for h in hiddens)
            and sequence_loss_chunkable(hiddens, weight, bias)):
        return sequence_chunked_loss(hiddens, ids, weight, bias, lambda lps, b0, b1: loss(lps, slice(b0, b1)))
    return loss([linear_logprobs(h, weight, i, bias) for h, i in zip(hiddens, ids)], slice(None))


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
        _check_reduction(reduction)
        self.loss_type, self.beta, self.label_smoothing = loss_type, float(beta), float(label_smoothing)
        self.gamma, self.reduction = float(gamma), reduction

    def forward(self, chosen_hidden: Tensor, rejected_hidden: Tensor, weight: Tensor, chosen_ids: Tensor,
                rejected_ids: Tensor, chosen_mask: Tensor, rejected_mask: Tensor,
                ref_chosen_logps: Optional[Tensor] = None, ref_rejected_logps: Optional[Tensor] = None,
                bias: Optional[Tensor] = None, num_items_in_batch: Optional[float] = None) -> Tensor:
        pairs = _group_count(chosen_hidden, num_items_in_batch)

        def loss(lps, sl):
            return preference_loss(lps[0], chosen_mask[sl], lps[1], rejected_mask[sl],
                                   ref_chosen_logps=_slice(ref_chosen_logps, sl),
                                   ref_rejected_logps=_slice(ref_rejected_logps, sl), loss_type=self.loss_type,
                                   beta=self.beta, label_smoothing=self.label_smoothing, gamma=self.gamma,
                                   reduction=self.reduction, num_items_in_batch=pairs)
        return _sequence_loss((chosen_hidden, rejected_hidden), (chosen_ids, rejected_ids), weight, bias,
                              self.reduction, loss)

    def extra_repr(self) -> str:
        return f"loss_type={self.loss_type!r}, beta={self.beta}, label_smoothing={self.label_smoothing}"


class CPOLoss(torch.nn.Module):
    """CPO (and SimPO, with alpha=0 and loss_type "simpo") from the policy's last hidden states of chosen
    and rejected answers and its output head, without the logits: ``linear_logprobs`` of each answer's
    tokens, then ``cpo_loss``. forward(chosen_hidden (B, T, H), rejected_hidden (B, T', H), weight
    (V, H), chosen_ids, rejected_ids, chosen_mask, rejected_mask, bias=None, num_items_in_batch=None,
    num_chosen_tokens=None) -> the loss."""

    def __init__(self, loss_type: str = "sigmoid", beta: float = 0.1, alpha: float = 1.0,
                 label_smoothing: float = 0.0, gamma: float = 0.5, reduction: str = "mean"):
        super().__init__()
        if loss_type not in CPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {CPO_LOSS_TYPES}, got {loss_type!r}")
        _check_reduction(reduction)
        self.loss_type, self.beta, self.alpha = loss_type, float(beta), float(alpha)
        self.label_smoothing, self.gamma, self.reduction = float(label_smoothing), float(gamma), reduction

    def forward(self, chosen_hidden: Tensor, rejected_hidden: Tensor, weight: Tensor, chosen_ids: Tensor,
                rejected_ids: Tensor, chosen_mask: Tensor, rejected_mask: Tensor, bias: Optional[Tensor] = None,
                num_items_in_batch: Optional[float] = None, num_chosen_tokens: Optional[float] = None) -> Tensor:
        pairs, tokens = _batch_counts(chosen_hidden, chosen_mask, num_items_in_batch, num_chosen_tokens)

        def loss(lps, sl):
            return cpo_loss(lps[0], chosen_mask[sl], lps[1], rejected_mask[sl], loss_type=self.loss_type,
                            beta=self.beta, alpha=self.alpha, label_smoothing=self.label_smoothing, gamma=self.gamma,
                            reduction=self.reduction, num_items_in_batch=pairs, num_chosen_tokens=tokens)
        return _sequence_loss((chosen_hidden, rejected_hidden), (chosen_ids, rejected_ids), weight, bias,
                              self.reduction, loss)

    def extra_repr(self) -> str:
        return f"loss_type={self.loss_type!r}, beta={self.beta}, alpha={self.alpha}"


class ORPOLoss(torch.nn.Module):
    """ORPO from the policy's last hidden states of chosen and rejected answers and its output head,
    without the logits: ``linear_logprobs`` of each answer's tokens, then ``orpo_loss``. forward as
    CPOLoss's."""

    def __init__(self, beta: float = 0.1, reduction: str = "mean"):
        super().__init__()
        _check_reduction(reduction)
        self.beta, self.reduction = float(beta), reduction

    def forward(self, chosen_hidden: Tensor, rejected_hidden: Tensor, weight: Tensor, chosen_ids: Tensor,
                rejected_ids: Tensor, chosen_mask: Tensor, rejected_mask: Tensor, bias: Optional[Tensor] = None,
                num_items_in_batch: Optional[float] = None, num_chosen_tokens: Optional[float] = None) -> Tensor:
        pairs, tokens = _batch_counts(chosen_hidden, chosen_mask, num_items_in_batch, num_chosen_tokens)

        def loss(lps, sl):
            return orpo_loss(lps[0], chosen_mask[sl], lps[1], rejected_mask[sl], beta=self.beta,
                             reduction=self.reduction, num_items_in_batch=pairs, num_chosen_tokens=tokens)
        return _sequence_loss((chosen_hidden, rejected_hidden), (chosen_ids, rejected_ids), weight, bias,
                              self.reduction, loss)

    def extra_repr(self) -> str:
        return f"beta={self.beta}"


class KTOLoss(torch.nn.Module):
    """KTO from the policy's last hidden states of unpaired completions and its output head, without the
    logits: ``linear_logprobs`` of the completion tokens, then ``kto_loss``. forward(hidden (B, T, H),
    weight (V, H), ids (B, T), mask (B, T), desirable (B,) bool, ref_logps (B,), kl=None, bias=None,
    num_items_in_batch=None) -> the loss. The reference point kl comes from mismatched completions:
    ``kto_kl(sums of linear_logprobs under no_grad, the reference model's)``."""

    def __init__(self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                 reduction: str = "mean"):
        super().__init__()
        _check_reduction(reduction)
        self.beta, self.reduction = float(beta), reduction
        self.desirable_weight, self.undesirable_weight = float(desirable_weight), float(undesirable_weight)

    def forward(self, hidden: Tensor, weight: Tensor, ids: Tensor, mask: Tensor, desirable: Tensor, ref_logps: Tensor,
                kl: Optional[Union[Tensor, float]] = None, bias: Optional[Tensor] = None,
                num_items_in_batch: Optional[float] = None) -> Tensor:
        completions = _group_count(hidden, num_items_in_batch)

        def loss(lps, sl):
            return kto_loss(lps[0], mask[sl], desirable[sl], ref_logps[sl], kl=kl, beta=self.beta,
                            desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight,
                            reduction=self.reduction, num_items_in_batch=completions)
        return _sequence_loss((hidden,), (ids,), weight, bias, self.reduction, loss)

    def extra_repr(self) -> str:
        return (f"beta={self.beta}, desirable_weight={self.desirable_weight}, "
                f"undesirable_weight={self.undesirable_weight}")
