"""The fused denoising step: the framework-neutral sampler math and commit rules, the
upstream step functions, and the framework-native samplers. Importing this package imports
neither torch nor jax."""
