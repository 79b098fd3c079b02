"""fuseforge: fused CUDA kernels for training PyTorch models.

Ops live under torch.ops.fuseforge.*; this package adds their fake kernels, autograd, the
functional API below, modules (fuseforge.nn) and optimizers (fuseforge.optim).
"""
from fuseforge._library import cuda_built, load as _load

_load()

from fuseforge.ops.add_mul_act import ACTIVATIONS, add_mul_act, add_mul_act_  # noqa: E402
from fuseforge import nn  # noqa: E402

__version__ = "0.1.0"
__all__ = ["ACTIVATIONS", "add_mul_act", "add_mul_act_", "cuda_built", "nn"]
