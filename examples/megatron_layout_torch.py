"""Megatron-Core's layout: sequence-first logits [s, b, v/tp] from a tensor-parallel output
layer, scored by Megatron-Bridge's DiffusionGemma loss without a copy or a gather.

    torchrun --nproc_per_node 2 examples/megatron_layout_torch.py

Megatron-Core's ``ColumnParallelLinear`` output layer gives each tensor-parallel rank its
columns of the vocabulary, sequence first: [s, b, v/tp] (``compute_language_model_loss``
transposes the labels to match). Here the logits reach ``diffusion_sft_loss`` as the
transposed view ``logits.transpose(0, 1)`` ([b, s, v/tp], not contiguous), inside
``vocab_parallel(tp_group, vocab_size=V)``: the row statistics merge with two all-reduces of
per-row floats over the group, and each rank's gradient lands in its own [s, b, v/tp] shard.
The vocabulary, V = 47, is padded to tp x 24 columns at tp = 2 (``vocab_size`` excludes the
padding; its columns get a zero gradient).
Every rank checks its loss and its gradient shard against the unsharded [b, s, v] loss.
"""

import torch
import torch.distributed as dist

import dlm_kernels.torch as dk
from dlm_kernels.testing import assert_close

S, B, V = 12, 2, 47  # sequence, batch, true vocabulary
MASK = V - 1


def main():
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    tp_group = dist.new_group(list(range(tp)))  # the tensor-parallel group: every rank here
    v_local = -(-V // tp)
    cols = slice(rank * v_local, (rank + 1) * v_local)  # this rank's vocabulary columns

    torch.manual_seed(0)  # every rank draws the same full problem
    full = torch.randn(B, S, v_local * tp) * 3  # [b, s, v] unsharded (padding columns too)
    x0 = torch.randint(0, V - 1, (B, S))  # clean tokens [b, s]
    xt = torch.where(torch.rand(B, S) < 0.5, MASK, x0)  # noisy canvas
    t = torch.rand(B) * 0.8 + 0.1
    loss_mask = (xt == MASK).float()
    sft = dict(variant="reweighted-loo-ce", vocab_size=V)

    # the output layer's shard on this rank, sequence first, as Megatron-Core returns it
    logits = full[..., cols].transpose(0, 1).contiguous().requires_grad_(True)  # [s, b, v/tp]
    with dk.vocab_parallel(tp_group, vocab_size=V):
        loss = dk.diffusion_sft_loss(logits.transpose(0, 1), x0, xt, t, loss_mask, **sft)  # [b]
    loss.mean().backward()  # logits.grad: [s, b, v/tp], this rank's columns

    whole = full[..., :V].clone().requires_grad_(True)  # [b, s, V], one device, no padding
    ref = dk.diffusion_sft_loss(whole, x0, xt, t, loss_mask, backend="reference", **sft)
    ref.mean().backward()
    assert_close(loss.detach().numpy(), ref.detach().numpy(), "float32", "loss")
    grad = logits.grad.transpose(0, 1)  # [b, s, v/tp]
    real = max(0, min(v_local, V - rank * v_local))  # this rank's columns below V
    assert_close(grad[..., :real].numpy(), whole.grad[..., cols][..., :real].numpy(),
                 "float32", "gradient")
    assert not grad[..., real:].any(), "padding columns get a zero gradient"
    print(f"rank {rank}/{tp}: loss {loss.mean().item():.6f} (unsharded "
          f"{ref.mean().item():.6f}), gradient shard {tuple(logits.grad.shape)} matches")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
