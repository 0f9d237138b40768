"""Compute kernels (imported as ``specmesh.kernels``).

Each Triton kernel lives beside a short PyTorch reference of the same maths; the runtime picks the
kernel on CUDA and the reference elsewhere, and the tests compare the two.
"""
