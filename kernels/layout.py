"""Buffer layouts shared by the kernels and the host code that allocates and reads them.

Defined once here; the Triton and Pallas kernels index their buffers with these positions and
the host (``dlm_kernels.token_stats.formulas.State`` / ``Stats``, the launchers) sizes and reads
the same buffers from them, so no buffer size or row index is written as a bare number.

PARTIAL_STATE: the streaming state of one row over a block of columns (docs/design.md §2), one
  float32 each: the running max m of the (capped, shifted) logits r, with x = (r - m)/T: Σ e^x,
  Σ e^x·x (entropy), Σ e^{x'} for the separate CE temperature (x' = (r - m)/T_ce); the
  teacher's running max mu of its logits u, with x_u = (u - mu)/T_kl: Σ e^{x_u},
  Σ e^{x_u}·y and Σ e^{x_u}·psi(y) with y = x_u - x and psi(y) = y - 1 + e^{-y} >= 0 (the
  KL's cancellation-free terms: dlm_kernels.token_stats.formulas); last, with label smoothing only,
  Σ r over the valid columns (logit units: merged by a plain sum).
  Triton's partial buffer is [len(PARTIAL_STATE), S, N] (S vocabulary splits; its last row,
  ``sr``, only allocated with label smoothing); Pallas's partial output is
  [N, len(PARTIAL_STATE)].
ROW_STATS: the finished statistics of a row, float32: the four public outputs, then the
  residuals the backward pass reads: E_q[x_u - x], the row maxima m and mu (in logit units)
  and the logs of the sums relative to them (la, la_ce, la_u: lse = m/T + la, ...), so that
  the backward forms log p = (r - m)/T - la from differences of logits, never from two
  scaled logits of size |r|/T. Triton's is [len(ROW_STATS), N].
SAMPLE_STATE / SAMPLE_IDS: the sampler's streaming state of one row over a block of columns
  (``dlm_kernels.sampling.core.StreamState``): float32 first PARTIAL_STATE's m, a, b of the
  statistics' distribution (the running max m of the logits r in logit units, Σ e^x and
  Σ e^x·x with x = (r - m)/T_s: the token statistics' own sums, so that the token-statistics
  finalize reads them as they are), then the largest and second largest s = r / T_s, the
  largest s + g (Gumbel key) and the logit r at it; int32 the id of the largest s and the id
  of the largest key. Triton's buffers are [len(SAMPLE_STATE), S, N] and
  [len(SAMPLE_IDS), S, N] (the first three rows of the float one are a [3, S, N] partial
  buffer for ``stats_finalize_kernel``); with top_k the k slots of each split follow as
  [S, N, k] values and ids (unsorted).
SAMPLE_ROW_STATS: what the Pallas sampler finalises in its kernel, as the token-statistics
  forward finalises its rows: the log of the sum la (lse = m/T_s + la), the drawn token's
  log-probability and the entropy; written after SAMPLE_STATE in its float output.
NO_VOCAB_LIMIT: the kernels' vocabulary limit when every column is real (int32 max).
"""

PARTIAL_STATE = ("m", "a", "b", "a2", "mu", "au", "cu", "fu", "sr")
ROW_STATS = ("lse", "logp", "entropy", "kl", "kl_shift", "m", "la", "la_ce", "mu", "la_u")
SAMPLE_STATE = ("m", "a", "b", "v1", "v2", "gv", "gz")
SAMPLE_ROW_STATS = ("la", "logp", "entropy")
assert SAMPLE_STATE[:3] == PARTIAL_STATE[:3]  # the sampler's buffer is a partial buffer too
SAMPLE_IDS = ("i1", "gi")
NO_VOCAB_LIMIT = 2**31 - 1
