"""Generating with transformers' DiffusionGemma on dlm-kernels' fused denoising step, on a
tiny random model (no download).

``apply_dlm_kernels_to_diffusion_gemma(model, fused_self_conditioning=True)`` replaces each
denoising step's [B, L, V] work: transformers forms the capped float32 logits, divides them by
the step's temperature, softmaxes them, draws with ``torch.multinomial``, takes the argmax and
the entropies (``Categorical``) in separate passes, and carries the processed logits to the
next step for self-conditioning. Patched, with no adaptive stopping and transformers' own
temperature schedule, the step reads the decoder's final hidden states through the capped
tied head: one streamed pass gives the draw, the argmax and the entropies (the entropy-bound
acceptance is transformers' rule, reproduced exactly), another the next step's
self-conditioning signal softmax(cap(h·W) / T)·E·sqrt(D), [B, L, D]. No [B, L, V] buffer
exists in the step. The draws use dlm-kernels' counter-based noise, seeded from torch's
generator: ``torch.manual_seed`` repeats a generation; transformers' own draws are equal in
distribution, not in bits.

    python examples/diffusion_gemma_generate.py
"""

from __future__ import annotations

import copy
import os
import sys

import torch

from dlm_kernels.torch.integrations import apply_dlm_kernels_to_diffusion_gemma
from dlm_kernels.torch.integrations import diffusion_gemma as integration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diffusion_gemma_train import CANVAS, PROMPT, V, tiny_model  # noqa: E402


def main(steps: int = 8, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = tiny_model().eval()
    reference = copy.deepcopy(model)  # transformers' own step, the same weights
    apply_dlm_kernels_to_diffusion_gemma(model, fused_self_conditioning=True)
    head_steps = []
    original = integration._head_step

    def counted(*args, **kwargs):  # to show which path each step took
        head_steps.append(1)
        return original(*args, **kwargs)

    integration._head_step = counted
    prompt = torch.randint(0, V - 3, (2, PROMPT))
    # no adaptive stopping: the step then has nothing else that reads the logits
    options = dict(max_new_tokens=CANVAS, max_denoising_steps=steps, stability_threshold=None,
                   confidence_threshold=None)
    try:
        runs = []
        for m in (model, model, reference):
            torch.manual_seed(seed + 1)
            with torch.no_grad():
                out = m.generate(prompt, **options)
            runs.append(out if isinstance(out, torch.Tensor) else out.sequences)
    finally:
        integration._head_step = original
    ours, again, theirs = runs
    print(f"patched:      {ours[0, PROMPT:PROMPT + CANVAS].tolist()}")
    print(f"transformers: {theirs[0, PROMPT:PROMPT + CANVAS].tolist()}")
    print(f"steps read through the head (no [B, L, V] logits): {len(head_steps)}; "
          f"repeated under torch.manual_seed: {torch.equal(ours, again)}")
    return {"ours": ours, "again": again, "theirs": theirs, "head_steps": len(head_steps)}


if __name__ == "__main__":
    main()
