"""Communication volume of the vocabulary-parallel path, measured from the compiled program.

``python -m bench.comm`` (its own process: it asks XLA for 8 host devices) compiles the JAX
vocab-parallel forward+backward on a 1 x 8 mesh for a few (N, K) and prints one JSON line:
all-reduce bytes per row read off the optimised HLO, next to the analytic 40 bytes per row
(a MAX of 2 floats and a SUM of 8). The torch path sends the same two all-reduces.
"""

import json
import os

from .hlo import allreduce_bytes

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def measure(n, k, shards=8, teacher=True):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import dlm_kernels.jax as dk

    mesh = Mesh(np.array(jax.devices()[:shards]).reshape(1, shards), ("data", "vocab"))

    def local(z, u, y, w):
        s = dk.token_stats(z, y, w, teacher_logits=u if teacher else None, vocab_axis="vocab",
                          ce_temperature=1.0, temperature=2.0)
        return s.logp + s.entropy + s.kl  # [N_local]

    tile, row = P("data", "vocab"), P("data")
    f = jax.shard_map(local, mesh=mesh, in_specs=(tile, tile, row, row), out_specs=row)
    args = (jax.ShapeDtypeStruct((n, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32))
    hlo = jax.jit(jax.value_and_grad(lambda *a: f(*a).sum())).trace(*args).lower().compile().as_text()
    per_op = allreduce_bytes(hlo)
    return dict(n=n, k=k, shards=shards, teacher=teacher, allreduce_ops=len(per_op),
                allreduce_bytes=sum(per_op), bytes_per_row=sum(per_op) / n,
                analytic_bytes_per_row=40, logits_bytes_per_row=2 * k)


def main():
    rows = [measure(n, k) for n, k in ((256, 8 * 4096), (1024, 8 * 4096), (1024, 8 * 32768))]
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
