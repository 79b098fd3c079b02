"""fuseforge: fused CUDA kernels for training PyTorch models.

Ops live under torch.ops.fuseforge.*; this package adds their fake kernels, autograd, the
functional API below, modules (fuseforge.nn), the optimizer (fuseforge.optim.AdamW) and
fuseforge.patch(model) for Hugging Face Llama-family models (attention, the loss, RMSNorm, rotary
embeddings and the gated MLP).
"""
import os as _os

from fuseforge._library import cuda_built, load as _load

with open(_os.path.join(_os.path.dirname(__file__), "VERSION")) as _f:
    __version__ = _f.read().strip()

_load()

from fuseforge.ops.add_mul_act import ACTIVATIONS, add_mul_act, add_mul_act_  # noqa: E402
from fuseforge.ops.attention import (attention, attention_varlen, cu_seqlens_from_lengths,  # noqa: E402
                                     cu_seqlens_from_position_ids)
from fuseforge.ops.glu import glu  # noqa: E402
from fuseforge.ops.layer_norm import layer_norm  # noqa: E402
from fuseforge.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from fuseforge.ops.linear_jsd import linear_jsd, linear_kl_div  # noqa: E402
from fuseforge.ops.logprobs import linear_logprobs  # noqa: E402
from fuseforge.ops.rms_norm import rms_norm  # noqa: E402
from fuseforge.ops.rotary import rotary  # noqa: E402
from fuseforge import nn, optim  # noqa: E402
from fuseforge.optim import AdamW  # noqa: E402
from fuseforge.patch import patch, unpatch  # noqa: E402

__all__ = ["ACTIVATIONS", "AdamW", "add_mul_act", "add_mul_act_", "attention", "attention_varlen", "cuda_built",
           "cu_seqlens_from_lengths", "cu_seqlens_from_position_ids", "glu", "layer_norm", "linear_cross_entropy",
           "linear_jsd",
           "linear_kl_div", "linear_logprobs", "nn", "optim", "patch", "rms_norm", "rotary", "unpatch"]
