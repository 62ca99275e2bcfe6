"""The linear head (``LinearHead``: logits made chunk by chunk from hidden states and the
LM head's weight): the shared suite (``suite.py``) and one test file per backend."""
