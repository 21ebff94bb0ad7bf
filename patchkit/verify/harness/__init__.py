"""JIT measurement harnesses: run the rendered kernels through MLX's own JIT.

The harnesses build their kernel source from the same template text the patch
renders, so what they measure is what would be patched. They import MLX lazily:
building sources and checking them needs no GPU and no MLX.
"""
