"""Device code of dlm-kernels (``dlm_kernels.kernels``): Triton and Pallas kernel bodies.

Kernels import no host code; host code imports kernels.
"""
