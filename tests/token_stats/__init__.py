"""The token-statistics primitive: the shared suite (``suite.py``) and one test file per
backend (``test_reference.py``, ``test_chunked.py``, ``test_triton.py``, ``test_pallas.py``;
``test_gpu.py``: real sizes on a CUDA GPU)."""
