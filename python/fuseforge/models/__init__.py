"""Models written with fuseforge ops, each beside the same model in plain PyTorch."""
from fuseforge.models.gpt import FuseforgeGPT, GPTConfig, TorchGPT, make_pair

__all__ = ["FuseforgeGPT", "GPTConfig", "TorchGPT", "make_pair"]
