"""A complete masked-diffusion generation loop in PyTorch with a tiny random model.

Each step scores the whole canvas, draws a token per position in one pass over the
vocabulary (``sample_tokens``: Gumbel-max at temperature T, the mask token suppressed), and
commits the most confident still-masked positions of the current block (LLaDA's
low-confidence remasking with a linear schedule, semi-autoregressive blocks).

    python examples/generate_torch.py
"""

import torch

import dlm_kernels.torch as dk

B, L, V, D = 2, 32, 500, 64  # batch, canvas length, vocabulary, width
MASK = V - 1  # the mask token's id
BLOCK, STEPS_PER_BLOCK = 8, 4

torch.manual_seed(0)
embed = torch.nn.Embedding(V, D)
position = torch.nn.Embedding(L, D)
mixer = torch.nn.Linear(D, D)
unembed = torch.nn.Linear(D, V)


@torch.no_grad()
def model(canvas):  # [B, L] ids -> [B, L, V] logits (a stand-in for a real denoiser)
    h = embed(canvas) + position(torch.arange(L))[None]
    h = h + torch.tanh(mixer(h.mean(dim=1, keepdim=True)))  # every position sees the canvas
    return unembed(h)


prompt = torch.randint(0, V - 1, (B, 4))
canvas = torch.full((B, L), MASK)
canvas[:, :4] = prompt
suppress = torch.tensor([MASK])
step = 0
for start in range(4, L, BLOCK):
    in_block = torch.zeros(B, L, dtype=torch.bool)
    in_block[:, start:start + BLOCK] = True
    for i in range(STEPS_PER_BLOCK):
        masked = (canvas == MASK) & in_block
        left = masked.sum(dim=1)  # per sequence
        k = torch.ceil(left / (STEPS_PER_BLOCK - i)).long()  # a linear schedule
        sample = dk.sample_tokens(model(canvas), temperature=0.8, seed=1234, step=step,
                                  suppress_ids=suppress)
        canvas, committed = dk.commit_tokens(canvas, sample, masked, rule="topk", k=k)
        step += 1
        print(f"step {step:2d}: committed {int(committed.sum())}, "
              f"mean entropy {float(sample.entropy[masked].mean()):.2f}")
print("canvas:", canvas.tolist())
print("masked left:", int((canvas == MASK).sum()))
