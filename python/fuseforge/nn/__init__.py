"""Drop-in modules built on the fuseforge ops."""
from fuseforge.nn.add_mul_act import AddMulActivation
from fuseforge.nn.attention import Attention
from fuseforge.nn.linear_cross_entropy import LinearCrossEntropyLoss

__all__ = ["AddMulActivation", "Attention", "LinearCrossEntropyLoss"]
