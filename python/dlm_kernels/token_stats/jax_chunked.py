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

from . import math as stats_math
from .._config import chunk_size_for
from .._dispatch import BackendBase, NATIVE_DTYPES, Capabilities
from .._jax.ops import JaxOps as xp


#: rows of one block of the forward: XLA's CPU compiler orders a row's sums by the shape it
#: reduces (a row of [2, C] and of [16, C] can differ in the last bit), so the forward reduces
#: blocks of this many rows whatever N is: a row gives the same bits in any batch
#: (docs/design.md §2, "One row, one answer").
ROW_BLOCK = 8


def _plan(z, cfg, on_cpu):
    n, k = z.shape
    c = chunk_size_for(k, cfg, on_cpu)
    return n, k, c, -(-k // c)


def _row_blocks(fn, rows, n):
    """fn(block) -> tuple of [ROW_BLOCK] arrays, over blocks of ROW_BLOCK rows of ``rows``
    ([N, ...] fields), joined into [N] arrays. The last block is clamped to end at row N
    (its rows that the block before it holds are computed again, to the same bits); fewer
    than ROW_BLOCK rows are padded by repeating the last row."""
    if n < ROW_BLOCK:
        pad = lambda f: None if f is None else jnp.concatenate(  # noqa: E731
            [f, jnp.repeat(f[-1:], ROW_BLOCK - n, axis=0)])
        return tuple(o[:n] for o in fn(type(rows)(*(pad(f) for f in rows))))
    count = -(-n // ROW_BLOCK)

    def block(i):
        start = jnp.minimum(i * ROW_BLOCK, n - ROW_BLOCK)
        take = lambda f: None if f is None else lax.dynamic_slice_in_dim(f, start, ROW_BLOCK)  # noqa: E731
        return start, fn(type(rows)(*(take(f) for f in rows)))

    def body(i, outs):
        start, parts = block(i)
        return tuple(lax.dynamic_update_slice_in_dim(o, p, start, axis=0)
                     for o, p in zip(outs, parts))

    # the first block peeled: its outputs give the [N] buffers' dtypes, and the carry varies
    # over the same shard_map axes as the inputs
    _, first = block(0)
    outs = tuple(jnp.zeros((n,), p.dtype).at[:ROW_BLOCK].set(p) for p in first)
    return lax.fori_loop(1, count, body, outs)


def _per_platform(run, z, cfg, cpu_differs=False):
    """run(on_cpu) for the platform the call is lowered for (``lax.platform_dependent``: a
    jitted function does not know its device while it is traced). The chunk differs (a
    CPU's is smaller, _config.chunk_size_for) and so may the CPU's gradient carry; when
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
            if n == 0:
                return tuple(jnp.zeros((0,), jnp.float32) for _ in stats_math.State._fields)
            return _row_blocks(lambda block: run_rows(block, k, c, n_chunks), rows, n)

        def run_rows(rows, k, c, n_chunks):
            z, u = rows.logits, rows.teacher

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
        n = z.shape[0]
        if 0 < n < 2 * ROW_BLOCK:  # two blocks: the rows padded by repeating the last
            pad = lambda f: None if f is None else jnp.concatenate(  # noqa: E731
                [f, jnp.repeat(f[-1:], 2 * ROW_BLOCK - n, axis=0)])
            dz, du = ChunkedJax.backward(type(rows)(*(pad(f) for f in rows)),
                                         type(stats)(*(pad(f) for f in stats)),
                                         tuple(pad(g) for g in grads), cfg, offset)
            return dz[:n], (None if du is None else du[:n])

        def gradient(on_cpu):
            n, k, c, n_chunks = _plan(z, cfg, on_cpu)
            carry_z = _carry_dtype(z.dtype, on_cpu)
            carry_u = None if u is None else _carry_dtype(u.dtype, on_cpu)

            def block(b, carry):
                # rows [r0, r0 + ROW_BLOCK) (the last block clamped to end at N): the
                # elementwise gradient of a fixed [ROW_BLOCK, C] shape, whose bits XLA's CPU
                # compiler may otherwise choose by the whole call's shape
                r0 = jnp.minimum(b * ROW_BLOCK, n - ROW_BLOCK)
                take = lambda f: None if f is None else lax.dynamic_slice_in_dim(  # noqa: E731
                    f, r0, ROW_BLOCK)
                rb = type(rows)(*(take(f) for f in rows))
                sb = type(stats)(*(take(f) for f in stats))
                gb = tuple(take(g) for g in grads)

                def body(i, carry):
                    dz, du = carry
                    z_i, u_i = _in_loop(i, z, u)
                    start = jnp.minimum(i * c, k - c)
                    cols = offset + start + jnp.arange(c, dtype=jnp.int32)
                    tile = lambda a: None if a is None else lax.dynamic_slice(  # noqa: E731
                        a, (r0, start), (ROW_BLOCK, c))
                    chunk = rb.columns(tile(z_i), tile(u_i))
                    gz, gu = stats_math.chunk_grads(xp, chunk, cols, sb, gb, cfg)
                    update = lambda buf, g, dtype, carry: lax.dynamic_update_slice(
                        buf, _to_carry(g, dtype, carry), (r0, start))
                    dz = update(dz, gz, z.dtype, carry_z)
                    if du is not None:
                        du = update(du, gu, u.dtype, carry_u)
                    return dz, du

                # the first chunk peeled (the carry then varies like the inputs under
                # shard_map), and computed again in the loop: every chunk of every block is
                # the loop's one program, the same bits for a row in any call
                return lax.fori_loop(0, n_chunks, body, body(0, carry))

            du0 = jnp.zeros(u.shape, carry_u) if cfg.TEACHER_GRAD else None
            first = block(0, (jnp.zeros(z.shape, carry_z), du0))
            dz, du = lax.fori_loop(0, -(-n // ROW_BLOCK), block, first)  # block 0 again, as above
            return _from_carry(dz, z.dtype), (None if du is None else _from_carry(du, u.dtype))

        if n == 0:
            return jnp.zeros(z.shape, z.dtype), (
                jnp.zeros(u.shape, u.dtype) if cfg.TEACHER_GRAD else None)
        half = _is_half(z.dtype) or (cfg.TEACHER_GRAD and _is_half(u.dtype))
        return _per_platform(gradient, z, cfg, cpu_differs=half)


IMPLEMENTATION = ChunkedJax()
