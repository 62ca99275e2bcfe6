"""The sampler (token draws from the statistics' distribution, commit rules) on every
backend: ``test_sampling.py`` holds its suite and one class per backend."""
