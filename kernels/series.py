"""The short series of the KL's cancellation-free form (docs/design.md §2, "The KL"), shared
by the Triton and Pallas kernels and the host's math (``dlm_kernels.token_stats.formulas``), so that
every backend evaluates the same polynomial.

psi(y) = y - 1 + e^{-y} >= 0 (a second-order quantity: y²/2 - y³/6 + ...). Formed as written
it cancels for small |y|: below ``PSI_SMALL`` it is y²·S(y) with the Taylor polynomial
S(y) = Σ_{n<5} (-y)^n / (n+2)! (truncation under 4e-7 of S there), above it the direct form
(at |y| = PSI_SMALL that loses at most about 64 float32 roundings of psi: 4e-6).
``PSI_COEFFS`` are S's coefficients for Horner's rule in y (constant term first);
``PSI_COEFFS_BASE2`` the same polynomial in y2 = y·log2 e, scaled so that
psi(y) = y2²·Σ PSI_COEFFS_BASE2[n]·y2^n (the Triton kernels' base-2 units).
"""

import math

PSI_SMALL = 0.25
PSI_COEFFS = tuple((-1.0) ** n / math.factorial(n + 2) for n in range(5))
PSI_COEFFS_BASE2 = tuple(c * math.log(2.0) ** (n + 2) for n, c in enumerate(PSI_COEFFS))
