"""The Megatron-Bridge DiffusionGemma schedule constants and SFT variant table."""

from __future__ import annotations

EPS = 1e-12

#: Megatron-Bridge DiffusionGemma SFT variants.
VARIANTS = ("base-sft", "reweighted-ce", "loo-ce", "reweighted-loo-ce")
_VARIANT_ALIASES = {"loo-reweighted-ce": "reweighted-loo-ce"}
REWEIGHTED_VARIANTS = frozenset({"reweighted-ce", "reweighted-loo-ce"})
LOO_VARIANTS = frozenset({"loo-ce", "reweighted-loo-ce"})

def normalize_variant(variant: str) -> str:
    """Canonical variant name; ``loo-reweighted-ce`` is an alias of ``reweighted-loo-ce``."""
    if not isinstance(variant, str):
        raise ValueError(f"variant must be a string, one of {VARIANTS}; got {variant!r}")
    name = _VARIANT_ALIASES.get(variant, variant)
    if name not in VARIANTS:
        raise ValueError(f"Unknown variant {variant!r}: variant must be one of {VARIANTS} "
                         f"(or alias 'loo-reweighted-ce')")
    return name
