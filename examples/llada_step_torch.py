"""LLaDA's semi-autoregressive generation loop in PyTorch, written against the upstream step
functions (``get_num_transfer_tokens``, ``get_transfer_index``) with a tiny random model.

The loop is LLaDA's ``generate.py`` as it stands (blocks, steps per block, the linear
schedule, low-confidence remasking); only the import changed: ``get_transfer_index`` reads
the logits once (no [B, L, K] float64 noise or softmax) and takes per-sequence seeds, so a
sequence decodes the same whatever its batch neighbours.

    python examples/llada_step_torch.py
"""

import torch

import dlm_kernels.torch as dk

B, PROMPT, GEN, V, D = 2, 4, 16, 300, 32  # batch, prompt, generated length, vocabulary, width
MASK = V - 1  # the mask token's id
BLOCK, STEPS = 8, 8  # block length, steps over the whole generation

torch.manual_seed(0)
embed = torch.nn.Embedding(V, D)
position = torch.nn.Embedding(PROMPT + GEN, D)
unembed = torch.nn.Linear(D, V)


@torch.no_grad()
def model(x):  # [B, L] ids -> [B, L, V] logits (a stand-in for a real mask predictor)
    h = embed(x) + position(torch.arange(x.shape[1]))[None]
    h = h + torch.tanh(h.mean(dim=1, keepdim=True))  # every position sees the canvas
    logits = unembed(h)
    logits[..., MASK] = float("-inf")  # a trained predictor never proposes the mask
    return logits


def generate(prompt, steps=STEPS, gen_length=GEN, block_length=BLOCK, temperature=0.7,
             remasking="low_confidence", seeds=None):
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), MASK, dtype=torch.long)
    x[:, :prompt.shape[1]] = prompt
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    step = 0
    for nb in range(num_blocks):
        start = prompt.shape[1] + nb * block_length
        block_mask_index = x[:, start:start + block_length] == MASK
        num_transfer_tokens = dk.get_num_transfer_tokens(block_mask_index, steps_per_block)
        for i in range(steps_per_block):
            mask_index = x == MASK
            mask_index[:, start + block_length:] = False
            x0, transfer_index = dk.get_transfer_index(
                model(x), temperature, remasking, mask_index, x, num_transfer_tokens[:, i],
                seed=seeds, step=step)
            x[transfer_index] = x0[transfer_index]
            step += 1
            print(f"block {nb} step {i}: committed {int(transfer_index.sum())}")
    return x


prompt = torch.randint(0, V - 1, (B, PROMPT))
seeds = torch.tensor([11, 22])
out = generate(prompt, seeds=seeds)
alone = generate(prompt[1:], seeds=seeds[1:])  # sequence 1 by itself: the same tokens
assert torch.equal(alone[0], out[1]), "per-sequence seeds: batch-invariant draws"
print("canvas:", out.tolist())
print("masked left:", int((out == MASK).sum()))
