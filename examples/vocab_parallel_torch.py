"""Megatron-style vocabulary-parallel loss with torch.distributed.

    torchrun --nproc_per_node 2 examples/vocab_parallel_torch.py

Each rank holds a contiguous shard of the vocabulary (here K = 50 padded to 2 x 25, so the
true vocab_size is given). Statistics merge with two all-reduces of per-row floats; the
backward is local to each rank's shard. Prints the same loss on every rank and checks it
against an unsharded computation.
"""

import torch
import torch.distributed as dist

import dlm_kernels.torch as dk


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = 50
    k_local = -(-vocab // world)
    torch.manual_seed(0)  # every rank draws the same full problem
    full = torch.randn(2, 8, k_local * world) * 3
    targets = torch.randint(0, vocab, (2, 8))
    weights = (torch.rand(2, 8) > 0.2).float()
    batch = dk.DiffusionTokenBatch.create(model_inputs=targets, target_ids=targets,
                                          loss_weights=weights)

    shard = full[..., rank * k_local:(rank + 1) * k_local].clone().requires_grad_(True)
    with dk.vocab_parallel(dist.group.WORLD, vocab_size=vocab):
        loss = dk.weighted_cross_entropy(shard, batch).compute()
    loss.backward()  # shard.grad: this rank's columns of d loss / d logits

    ref = dk.weighted_cross_entropy(full[..., :vocab], batch, backend="reference").compute()
    assert torch.allclose(loss, ref, rtol=1e-5), (loss, ref)
    print(f"rank {rank}/{world}: loss {loss.item():.6f} (unsharded {ref.item():.6f})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
