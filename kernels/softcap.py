"""The softcap cap(z) = c·tanh(z / c) in float32: constants shared by the kernels and the
host math (docs/design.md §2).

Where |z / c| < TANH_SERIES_BOUND every backend computes cap(z) = z·(1 + u·Q(u)), u = (z / c)²,
with Q the polynomial whose coefficients are TANH_SERIES (tanh(x) = x + x·u·Q(u)): z never
makes a round trip through z / c, so cap(z) is z to float32 wherever z / c is tiny, subnormal
or flushed to 0 (c up to the float32 maximum); and a tanh formed as (1 - e)/(1 + e),
e = e^{-2|x|}, which cancels for small |x|, is used only beyond the bound. There cap(z) is
c·sign(x)·(1 - e)/(1 + e), x = z / c, in every backend. The derivative cap'(z) = 1 - tanh²(x)
is formed as 4e / (1 + e)² everywhere (the host's autodiff of that tanh gives the same):
precise relative to itself, where 1 - th² from a rounded th is only precise to float32's
absolute 6e-8 (10 % off at |x| = 8, 0 past 9, where tanh saturates).
(Past c = 2^126, 1/c is subnormal, 0 where subnormals flush: there logits past
0.625·2^126, about 5e37, are capped inaccurately or not at all; all others are z.)

Q: a least-squares fit, reweighted towards minimax, of (tanh(x)/x - 1)/x² over |x| <= 0.625;
relative error of x + x·u·Q(u) below 5e-9 (0.07 float32 ulps), within 0.75 ulp of tanh when
evaluated in float32 by Horner's rule.
"""

TANH_SERIES_BOUND = 0.625
TANH_SERIES = (-0.3333328200742831, 0.13331443662837195, -0.05373982127998809,
               0.020639396969128077, -0.005705302089361056)  # Q(u) = Σ_i TANH_SERIES[i]·u^i
