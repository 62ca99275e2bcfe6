"""Training transformers' DiffusionGemma with dlm-kernels' fused loss, on a tiny random model
(no download), then one generation with the fused denoising step.

``apply_dlm_kernels_to_diffusion_gemma(model)`` makes ``model(..., labels=x0)`` return the
token-mean cross-entropy of the capped logits (30·tanh(z / 30)) from the decoder's final
hidden states and the tied embedding table, without forming the [B, L, V] logits
(``logits`` is None in training), and ``model.generate`` draw, take the argmax and accept by
the entropy bound in one pass over each step's logits. Called with no model, before the model
is built, it patches the class instead, as Liger-Kernel's ``apply_liger_kernel_to_*`` do.

The task: the canvas (16 tokens) is the prompt's 8 tokens, twice. Each step corrupts the
clean canvas x0 with uniform random tokens at a random rate t (DiffusionGemma's noise: its
sampler renoises with random tokens) and trains the decoder to predict x0 at every position,
and the encoder to predict the prompt's next token (``encoder_labels``).

    python examples/diffusion_gemma_train.py
"""

from __future__ import annotations

import argparse

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

from dlm_kernels.torch.integrations import apply_dlm_kernels_to_diffusion_gemma

V, D, PROMPT, CANVAS = 512, 64, 8, 16


def tiny_model() -> DiffusionGemmaForBlockDiffusion:
    """2 layers, width 64, 4 experts (2 per token), vocabulary 512, canvas 16."""
    text = dict(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=32,
                num_experts=4, top_k_experts=2, moe_intermediate_size=32, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=256)
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=16)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=CANVAS,
                                  boi_token_id=V - 3, eoi_token_id=V - 2, image_token_id=V - 1)
    return DiffusionGemmaForBlockDiffusion(config)


def main(steps: int = 30, batch: int = 8, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    model = tiny_model().train()
    apply_dlm_kernels_to_diffusion_gemma(model)  # this model; no argument: the class
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    prompts = torch.randint(0, V - 3, (batch, PROMPT))
    x0 = prompts.repeat(1, CANVAS // PROMPT)  # the clean canvas
    log = []
    for step in range(steps):
        t = torch.rand(batch, 1) * 0.8 + 0.2  # corruption rate per sequence
        noise = torch.randint(0, V, x0.shape)
        xt = torch.where(torch.rand(x0.shape) < t, noise, x0)  # the noisy canvas
        encoder_labels = prompts.clone()
        out = model(input_ids=prompts, decoder_input_ids=xt, labels=x0,
                    encoder_labels=encoder_labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.append({"step": step, "loss": out.loss.item(), "logits_formed": out.logits is not None})
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {out.loss.item():.4f}  logits formed: "
                  f"{out.logits is not None}")
    model.eval()
    with torch.no_grad():  # the fused denoising step, inside transformers' generate
        generated = model.generate(prompts[:1], max_new_tokens=CANVAS, max_denoising_steps=8)
    sequences = generated if isinstance(generated, torch.Tensor) else generated.sequences
    canvas = sequences[0, PROMPT:PROMPT + CANVAS]
    match = (canvas == x0[0, :canvas.numel()]).float().mean().item()
    print(f"generated canvas: {canvas.tolist()}\nshare equal to the training target: {match:.2f}")
    log.append({"generated": sequences, "match": match})
    return log


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    main(steps=args.steps)
