"""cs336_kernels."""
