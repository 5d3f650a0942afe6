"""Triton kernels, each beside its launcher: signals and the barrier, the persistent GEMMs, the reduction,
attention forward and backward."""
