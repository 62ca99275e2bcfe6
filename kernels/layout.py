"""Buffer layouts shared by the kernels and the host code that allocates and reads them.

Defined once here; the Triton and Pallas kernels index their buffers with these positions and
the host code (``dlm_kernels._stats_math.State`` / ``Stats``, the launchers) sizes and reads
the same buffers from them, so no buffer size or row index is written as a bare number.

PARTIAL_STATE: the streaming state of one row over a block of columns (docs/design.md §2), one
  float32 each: running max of s, Σ e^{s-m}, Σ e^{s-m}(s-m) (entropy), the max and sum for the
  separate CE temperature, and the teacher's max, Σ e^{t-mu}, Σ e^{t-mu}·y and
  Σ e^{t-mu}·psi(y) with y = (t - mu) - (s - m) and psi(y) = y - 1 + e^{-y} (the KL's terms:
  dlm_kernels._stats_math).
  Triton's partial buffer is [len(PARTIAL_STATE), S, N] (S vocabulary splits); Pallas's
  partial output is [N, len(PARTIAL_STATE)].
ROW_STATS: the finished statistics of a row, float32: the four public outputs, then the three
  residuals the backward pass reads. Triton's is [len(ROW_STATS), N].
SAMPLE_STATE / SAMPLE_IDS: the sampler's streaming state of one row over a block of columns
  (``dlm_kernels._sampling.StreamState``): float32 m (the running max of s, 0 while every s is
  -inf), Σ e^{s-m}, Σ e^{s-m}(s-m), the largest and second largest s, the largest s + g
  (Gumbel key) and s at it; int32 the id of the largest s and the id of the largest key.
  Triton's buffers are [len(SAMPLE_STATE), S, N] and [len(SAMPLE_IDS), S, N]; with top_k the
  k slots of each split follow as [S, N, k] values and ids (unsorted).
NO_VOCAB_LIMIT: the kernels' vocabulary limit when every column is real (int32 max).
"""

PARTIAL_STATE = ("m", "a", "b", "m2", "a2", "mu", "au", "cu", "fu")
ROW_STATS = ("lse", "logp", "entropy", "kl", "lse_ce", "lse_u", "kl_shift")
SAMPLE_STATE = ("m", "a", "b", "v1", "v2", "gv", "gs")
SAMPLE_IDS = ("i1", "gi")
NO_VOCAB_LIMIT = 2**31 - 1
