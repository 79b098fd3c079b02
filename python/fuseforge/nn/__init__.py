"""Drop-in modules built on the fuseforge ops."""
from fuseforge.nn.add_mul_act import AddMulActivation

__all__ = ["AddMulActivation"]
