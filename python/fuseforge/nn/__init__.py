"""Drop-in modules built on the fuseforge ops."""
from fuseforge.nn.add_mul_act import AddMulActivation
from fuseforge.nn.attention import Attention
from fuseforge.nn.distill import LinearJSD
from fuseforge.nn.glu import GLU, GatedMLP
from fuseforge.nn.layer_norm import LayerNorm
from fuseforge.nn.linear_cross_entropy import LinearCrossEntropyLoss
from fuseforge.nn.posttraining import (CPOLoss, GRPOLoss, KTOLoss, ORPOLoss, PreferenceLoss, cpo_loss, grpo_loss,
                                       kto_kl, kto_loss, orpo_loss, preference_loss)
from fuseforge.nn.rms_norm import RMSNorm
from fuseforge.nn.rotary import RotaryEmbedding

__all__ = ["AddMulActivation", "Attention", "CPOLoss", "GLU", "GatedMLP", "GRPOLoss", "KTOLoss", "LayerNorm",
           "LinearCrossEntropyLoss", "LinearJSD", "ORPOLoss", "PreferenceLoss", "RMSNorm", "RotaryEmbedding",
           "cpo_loss", "grpo_loss", "kto_kl", "kto_loss", "orpo_loss", "preference_loss"]
