"""dlm-kernels benchmarks: the main-job runner (``python -m bench``) and microbenchmarks."""
