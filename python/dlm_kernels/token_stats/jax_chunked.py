"""The chunked backend: jax.numpy over vocabulary chunks inside ``lax.fori_loop``.

Chunks are taken with ``lax.dynamic_slice`` (a reshape + scan would copy the logits). K need
not divide by the chunk C: the last chunk starts at K - C and masks the columns an earlier
chunk already counted. Backward recomputes p (and q) per chunk and writes d(logits) with
``lax.dynamic_update_slice``; overlapping columns are rewritten with identical values.
Live float32 temporaries are a few [N, C] buffers, never [N, K] (on CPU a 16-bit gradient
is carried as its bits: one more buffer of the gradient's size). With a column ``offset``
(traced: ``axis_index * K`` inside ``shard_map``) the logits are one vocabulary shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import formulas as stats_math
from .._config import budget_chunk_for
from .._dispatch import BackendBase, NATIVE_DTYPES, Capabilities
from .._jax.ops import JaxOps as xp


def vocab_chunk(n, k, cfg, on_cpu):
    """Columns C of the forward's vocabulary chunks for [N, K] logits (the chunked sampler's
    too, so that its statistics stream the same chunks)."""
    return budget_chunk_for(n, k, cfg, on_cpu)


def _plan(z, cfg, on_cpu):
    n, k = z.shape
    c = vocab_chunk(n, k, cfg, on_cpu)
    return n, k, c, -(-k // c)


def _per_platform(run, z, cfg, cpu_differs=False):
    """run(on_cpu) for the platform the call is lowered for (``lax.platform_dependent``: a
    jitted function does not know its device while it is traced). The chunk differs (a
    CPU's is smaller, _config.budget_chunk_for) and so may the CPU's gradient carry; when
    neither does, the one program is traced once."""
    if not cpu_differs and _plan(z, cfg, True)[2] == _plan(z, cfg, False)[2]:
        return run(True)
    return lax.platform_dependent(cpu=lambda: run(True), default=lambda: run(False))


def _slice(a, start, c):
    return None if a is None else lax.dynamic_slice_in_dim(a, start, c, axis=1)


def _in_loop(i, z, u):
    """z, u as seen from iteration i of a chunk loop (same values, no copy).

    XLA's CPU compiler does bfloat16 slicing in float32: it converts the *whole* operand,
    then hoists that conversion out of the loop as loop-invariant, so a bfloat16 call would
    hold a [N, K] float32 copy of the logits (forward at N 512, K 32768 on two cores: 26 ms;
    8 ms without the copy). Passing the operands through an optimization barrier together
    with the loop index makes them loop-variant, so each chunk converts only its own slice."""
    z, u, _ = lax.optimization_barrier((z, u, i))
    return z, u


def _is_half(dtype):
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def _carry_dtype(dtype, on_cpu):
    """The gradient buffer's dtype in the backward loop: on CPU a 16-bit float gradient is
    carried as its uint16 bits. XLA's CPU compiler has no 16-bit float dynamic-update-slice:
    it would convert the *whole* [N, K] buffer to float32 and back at every chunk (forward +
    gradient at N 512, K 32768 on two cores: 160 ms, 51 ms with the bits). An integer update
    is native; the one bitcast at the end costs a copy of the gradient (a [N, K] temporary of
    the gradient's own 2 bytes per element). Other platforms update 16-bit floats natively."""
    return jnp.uint16 if on_cpu and _is_half(dtype) else dtype


def _to_carry(g, dtype, carry):
    """A float32 gradient chunk in ``dtype``, bitcast to the carry's dtype when it differs."""
    g = g.astype(dtype)
    return g if carry == dtype else lax.bitcast_convert_type(g, carry)


def _from_carry(buf, dtype):
    return buf if buf.dtype == dtype else lax.bitcast_convert_type(buf, dtype)


class ChunkedJax(BackendBase):
    name = "chunked"
    custom_vjp = True
    capabilities = Capabilities(dtypes=NATIVE_DTYPES, vocab_shards=True)

    @staticmethod
    def unsupported_reason(platform):
        return None

    @staticmethod
    def forward_partial(rows, cfg, offset=0):
        # rows.logits, rows.teacher: [N, K] (one shard) -> (State, r_y, found) of [N] f32
        z, u = rows.logits, rows.teacher

        def run(on_cpu):
            n, k, c, n_chunks = _plan(z, cfg, on_cpu)

            def body(i, state):
                z_i, u_i = _in_loop(i, z, u)
                start = jnp.minimum(i * c, k - c)
                local = start + jnp.arange(c, dtype=jnp.int32)  # [C]
                cols = offset + local  # global column ids
                valid = stats_math.column_mask(xp, cols, cfg, local >= i * c)  # clamped last: skip seen
                chunk = rows.columns(_slice(z_i, start, c), _slice(u_i, start, c))
                return stats_math.merge(xp, stats_math.State(*state), stats_math.chunk_partial(xp, chunk, cols, valid, cfg),
                               cfg)

            # The first chunk is peeled so the loop carry starts from values that vary over
            # the same shard_map axes as the inputs (a constant initial state would not).
            cols = offset + jnp.arange(c, dtype=jnp.int32)
            first = stats_math.chunk_partial(xp, rows.columns(_slice(z, 0, c), _slice(u, 0, c)), cols,
                                    stats_math.column_mask(xp, cols, cfg), cfg)
            return tuple(lax.fori_loop(1, n_chunks, body, first))

        state = _per_platform(run, z, cfg)
        return (stats_math.State(*state), *stats_math.target_logit(xp, rows, cfg, offset))

    @classmethod
    def forward(cls, rows, cfg):
        state, r_y, found = cls.forward_partial(rows, cfg)
        return stats_math.finalize(xp, state, r_y, found, rows.active, cfg)

    @staticmethod
    def backward(rows, stats, grads, cfg, offset=0):
        # -> dz [N, K] in z's dtype, du [N, K] in u's dtype or None
        z, u = rows.logits, rows.teacher

        def gradient(on_cpu):
            n, k, c, n_chunks = _plan(z, cfg, on_cpu)
            carry_z = _carry_dtype(z.dtype, on_cpu)
            carry_u = None if u is None else _carry_dtype(u.dtype, on_cpu)

            def body(i, carry):
                dz, du = carry
                z_i, u_i = _in_loop(i, z, u)
                start = jnp.minimum(i * c, k - c)
                cols = offset + start + jnp.arange(c, dtype=jnp.int32)
                chunk = rows.columns(_slice(z_i, start, c), _slice(u_i, start, c))
                gz, gu = stats_math.chunk_grads(xp, chunk, cols, stats, grads, cfg)
                update = lambda buf, g, dtype, carry: lax.dynamic_update_slice_in_dim(
                    buf, _to_carry(g, dtype, carry), start, axis=1)
                dz = update(dz, gz, z.dtype, carry_z)
                if du is not None:
                    du = update(du, gu, u.dtype, carry_u)
                return dz, du

            du0 = jnp.zeros(u.shape, carry_u) if cfg.TEACHER_GRAD else None
            # peeled first chunk: the carry then varies like the inputs under shard_map
            first = body(0, (jnp.zeros(z.shape, carry_z), du0))
            dz, du = lax.fori_loop(1, n_chunks, body, first)
            return _from_carry(dz, z.dtype), (None if du is None else _from_carry(du, u.dtype))

        half = _is_half(z.dtype) or (cfg.TEACHER_GRAD and _is_half(u.dtype))
        return _per_platform(gradient, z, cfg, cpu_differs=half)


IMPLEMENTATION = ChunkedJax()
