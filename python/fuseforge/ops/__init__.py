"""Functional API, fake kernels and autograd of each torch.ops.fuseforge op (one module an op)."""
