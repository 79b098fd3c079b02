"""fused AdamW ops: fake kernels and the functional API.

torch.ops.fuseforge.adamw_fused_ updates one parameter group given as tensor lists (like
torch._fused_adamw_, but it also advances ``state_steps``): one kernel launch for every tensor of
the lists, whatever their number and dtypes. fuseforge.optim.AdamW uses it under torch.compile;
in eager mode it uses the handle ops (adamw_handle_*), which keep the parameter list in C++ so a
step costs no Python loop over parameters (those are eager-only: they take an opaque handle).
torch.ops.fuseforge.adamw_is_managed(t) says whether t lies in CUDA managed memory, where
``paged=True`` keeps the optimizer's states (eager-only too: a fact about an address).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

_ops = torch.ops.fuseforge


def adamw_fused_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                 exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor],
                 master_params: Sequence[Tensor], state_steps: Sequence[Tensor], *, lr: float,
                 beta1: float, beta2: float, weight_decay: float, eps: float, maximize: bool = False,
                 lr_tensor: Optional[Tensor] = None, grad_scale: Optional[Tensor] = None,
                 found_inf: Optional[Tensor] = None, exp_avg_absmaxs: Sequence[Tensor] = (),
                 exp_avg_sq_absmaxs: Sequence[Tensor] = ()) -> None:
    """One AdamW step (decoupled weight decay, bias correction; the math of torch.optim.AdamW) over
    tensor lists, in place. States have the params' sizes and strides; ``state_steps`` are float32
    scalars on the params' device, advanced by one (unless ``found_inf`` is set, which skips the
    whole step). ``max_exp_avg_sqs`` empty means no amsgrad; ``master_params`` empty means no
    master weights (else float32 copies of the float16/bfloat16 params, updated and rounded into
    the params).

    Each tensor's state format follows its ``exp_avgs`` entry: float32 (float64 for float64 params
    on the CPU), bfloat16 (stochastically rounded), or uint8 int8 codes, whose block scales (float32,
    one per 256 elements) are the matching ``exp_avg_absmaxs`` / ``exp_avg_sq_absmaxs`` entries
    (those lists are empty when no tensor has int8 states; other entries are not read)."""
    _ops.adamw_fused_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs),
                      list(master_params), list(state_steps), list(exp_avg_absmaxs), list(exp_avg_sq_absmaxs),
                      lr=float(lr), beta1=float(beta1),
                      beta2=float(beta2), weight_decay=float(weight_decay), eps=float(eps),
                      maximize=bool(maximize), lr_tensor=lr_tensor, grad_scale=grad_scale, found_inf=found_inf)


@torch.library.register_fake("fuseforge::adamw_fused_")
def _adamw_fused_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps,
                      exp_avg_absmaxs, exp_avg_sq_absmaxs, *, lr, beta1, beta2, weight_decay, eps, maximize,
                      lr_tensor=None, grad_scale=None, found_inf=None):
    return None


@torch.library.register_fake("fuseforge::adamw_handle_step")
def _adamw_handle_step_fake(handle, steps, hypers, lr_tensors, grad_scale, found_inf):
    return 0
