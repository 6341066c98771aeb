"""Kernels of slora: Triton kernels for CUDA, each beside a torch reference with the same signature.

`slora.kernels.reference` holds the torch versions used by the CPU engine and by the tests.
"""
