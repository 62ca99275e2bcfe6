"""Buffer layouts shared by the kernels and the host code that allocates and reads them.

Defined once here; the Triton and Pallas kernels index their buffers with these positions and
the host code (``dlm_kernels._stats_math.State`` / ``Stats``, the launchers) sizes and reads
the same buffers from them, so no buffer size or row index is written as a bare number.

PARTIAL_STATE: the streaming state of one row over a block of columns (docs/design.md §2), one
  float32 each: running max of s, Σ e^{s-m}, Σ e^{s-m}(s-m) (entropy), the max and sum for the
  separate CE temperature, and the teacher's max, Σ e^{t-mu}, Σ e^{t-mu}(t - s).
  Triton's partial buffer is [len(PARTIAL_STATE), S, N] (S vocabulary splits); Pallas's
  partial output is [N, len(PARTIAL_STATE)].
ROW_STATS: the finished statistics of a row, float32: the four public outputs, then the three
  residuals the backward pass reads. Triton's is [len(ROW_STATS), N].
NO_VOCAB_LIMIT: the kernels' vocabulary limit when every column is real (int32 max).
"""

PARTIAL_STATE = ("m", "a", "b", "m2", "a2", "mu", "au", "cu")
ROW_STATS = ("lse", "logp", "entropy", "kl", "lse_ce", "lse_u", "kl_shift")
NO_VOCAB_LIMIT = 2**31 - 1
