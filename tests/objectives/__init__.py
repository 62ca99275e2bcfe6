"""The front ends' objectives (SFT, weighted CE, per-token log-probs, OPD) on every backend:
the shared suites and input builders (``suite.py``) and one test file per backend."""
