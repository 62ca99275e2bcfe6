"""dlm-kernels under other libraries' models: one call patches a model class (before the
model is built) or one model instance, in the manner of Liger-Kernel's
``apply_liger_kernel_to_*`` functions.

    from dlm_kernels.torch.integrations import apply_dlm_kernels_to_diffusion_gemma
    apply_dlm_kernels_to_diffusion_gemma()          # every DiffusionGemmaForBlockDiffusion
    apply_dlm_kernels_to_diffusion_gemma(model)     # or this one model

``MODEL_TYPE_TO_APPLY_FN`` maps a transformers ``config.model_type`` to its patch, and
``apply_dlm_kernels(model)`` looks a model's up. Importing this package never imports
transformers; a patch imports it when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .diffusion_gemma import apply_dlm_kernels_to_diffusion_gemma

__all__ = ["MODEL_TYPE_TO_APPLY_FN", "apply_dlm_kernels", "apply_dlm_kernels_to_diffusion_gemma"]

MODEL_TYPE_TO_APPLY_FN: dict[str, Callable[..., None]] = {
    "diffusion_gemma": apply_dlm_kernels_to_diffusion_gemma,
}
"""transformers' ``config.model_type`` -> the function that patches that model."""


def apply_dlm_kernels(model: Any = None, *, model_type: str | None = None,
                      **options: Any) -> None:
    """Patch ``model`` (an instance; its ``config.model_type`` picks the patch) or, with
    ``model=None``, the model class of ``model_type``. ``options`` go to the patch function
    (e.g. ``fused_sampling=False``). A model type without a patch is a ValueError naming the
    types there are."""
    if model is None and model_type is None:
        raise ValueError("apply_dlm_kernels needs a model instance or model_type=")
    if model is not None:
        seen = getattr(getattr(model, "config", None), "model_type", None)
        if model_type is not None and seen != model_type:
            raise ValueError(f"model_type={model_type!r} but the model's config.model_type "
                             f"is {seen!r}")
        model_type = seen
    fn = MODEL_TYPE_TO_APPLY_FN.get(model_type) if isinstance(model_type, str) else None
    if fn is None:
        raise ValueError(f"no dlm-kernels patch for model_type {model_type!r}; patches exist "
                         f"for {sorted(MODEL_TYPE_TO_APPLY_FN)}")
    fn(model, **options)
