"""The chunked backend: jax.numpy over tiles of rows and vocabulary columns inside
``lax.fori_loop``.

One row, one answer (docs/design.md §2): a row's bits do not depend on the other rows of the
call. The vocabulary chunk C is fixed by K (``_config.chunk_size_for``: 4096 columns on a
CPU, 32768 elsewhere, or the user's ``chunk_size``), so a row's terms are summed in an order
fixed by K. Memory is bounded by cutting the rows into blocks of R rows
(``_config.group_rows_per_block``, from C alone); every block's row count is a multiple of
``ROW_GROUP`` (8), because XLA's CPU compiler computes exp and log of a row's [N] values with
other code in the last N mod 8 lanes of a shape, and at least ``_config.min_block_rows(C)``,
because it emits other code for an [R, C] tile of under about 4096 elements
(``_config.row_blocks``: full blocks, then one block ending at row N that overlaps the last
full block and computes its rows again). A call of fewer rows runs as that many (its rows
and zero rows: a copy of min_block_rows(C) x K logits, small unless a user's chunk_size is
small: 1024 x K at a chunk of 16).

Tiles are taken with ``lax.dynamic_slice`` from the whole logits at (first row, first
column) (slicing a block of rows first, or a reshape + scan, would copy the logits). K need
not divide by the chunk C: the last chunk starts at K - C and masks the columns an earlier
chunk already counted. Backward recomputes p (and q) per tile and writes d(logits) with
``lax.dynamic_update_slice``; overlapping columns and rows are rewritten with identical
values. Live float32 temporaries are a few [R, C] tiles, never [N, K] (on CPU a 16-bit
gradient is carried as its bits: one more buffer of the gradient's size). With a column
``offset`` (traced: ``axis_index * K`` inside ``shard_map``) the logits are one vocabulary
shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import formulas as stats_math
from .._config import chunk_size_for, group_rows_per_block, min_block_rows, row_blocks
from .._dispatch import BackendBase, NATIVE_DTYPES, Capabilities
from .._jax.ops import JaxOps as xp


def vocab_chunk(k, cfg, on_cpu):
    """Columns C of the vocabulary chunks of [N, K] logits: a function of K (and the user's
    chunk_size) alone. The chunked sampler streams the same chunks."""
    return chunk_size_for(k, cfg, on_cpu)


def _plan(z, cfg, on_cpu):
    """(K, C, number of chunks, rows per full block) of [N, K] logits."""
    k = z.shape[1]
    c = vocab_chunk(k, cfg, on_cpu)
    return k, c, -(-k // c), group_rows_per_block(c, on_cpu)


def least_rows(k, cfg):
    """The fewest rows of a block of [N, K] logits (``_config.min_block_rows`` of the chunk;
    the same on every platform: a CPU's chunk differs from another device's only where both
    need ROW_GROUP rows). A call of fewer rows runs padded to it."""
    return min_block_rows(vocab_chunk(k, cfg, True))


def fold_row_blocks(step, n, r, carry, least):
    """``carry`` through ``step(carry, row0, rows)`` over the row blocks of N >= ``least``
    rows (``_config.row_blocks``; ``rows`` static, ``row0`` traced). Every block runs inside
    a loop whose trip count XLA cannot see (an optimization barrier), even a single block:
    XLA compiles the body of a loop of blocks differently from a block outside one (a
    row's gradient came out an ulp apart), and it would unroll a loop of one trip. ``carry``
    must vary over the shard_map axes of what ``step`` reads (``varying_like``)."""
    rb, full, tail = row_blocks(n, r, least)

    def blocks(carry, first, count, rows):
        first = lax.optimization_barrier(jnp.int32(first))
        return unseen_trip_loop(count, lambda j, c: step(c, first + j * rows, rows), carry)

    carry = blocks(carry, 0, full, rb)
    if tail:
        carry = blocks(carry, n - tail, 1, tail)
    return carry


def unseen_trip_loop(count, body, carry):
    """``lax.fori_loop(0, count, body, carry)`` whose trip count XLA cannot see (an
    optimization barrier): every trip, a lone one too, runs the one compiled loop body (XLA
    unrolls a loop of one trip and compiles a body peeled out of a loop to other bits)."""
    return lax.fori_loop(0, lax.optimization_barrier(jnp.int32(count)), body, carry)


def fold_row_outputs(block, n, r, least, dtypes, like):
    """[N] arrays of ``dtypes`` (float32 or int32) from ``block(row0, nb)``, a tuple of [nb]
    arrays, over the row blocks of ``fold_row_blocks``. The loop carries them as one
    [len(dtypes), N] float32 buffer (int32 as its bits): XLA drops a loop's carried values
    that nothing reads afterwards, and the rest of the body then compiled to other bits (a
    logp an ulp apart when the caller did not read the entropy beside it); in one buffer
    every block computes every output, whatever the caller reads. ``like``: the trees the
    buffer must vary like under shard_map (``varying_like``)."""
    as_f32 = lambda o, d: o.astype(d) if d == jnp.float32 else lax.bitcast_convert_type(  # noqa: E731
        o.astype(d), jnp.float32)

    def step(buf, row0, nb):
        out = jnp.stack([as_f32(o, d) for o, d in zip(block(row0, nb), dtypes)])
        return lax.dynamic_update_slice_in_dim(buf, out, row0, axis=1)  # any index dtype (x64)

    buf = varying_like(jnp.zeros((len(dtypes), n), jnp.float32), *like)
    buf = fold_row_blocks(step, n, r, buf, least)
    return tuple(b if d == jnp.float32 else lax.bitcast_convert_type(b, d)
                 for b, d in zip(buf, dtypes))


def varying_like(x, *trees):
    """x made to vary over every shard_map axis a leaf of ``trees`` varies over (x itself
    outside shard_map): a loop carry that starts as a constant has the type of its result."""
    axes = frozenset().union(*(xp.varying_axes(leaf) for tree in trees
                               for leaf in jax.tree.leaves(tree)))
    missing = axes - xp.varying_axes(x)
    return xp.to_varying(x, tuple(sorted(missing))) if missing else x


def _padded_bundle(rows, m):
    """A bundle of fewer than m rows as m rows (the extra ones inactive)."""
    return rows._replace(**{f: xp.pad_rows(getattr(rows, f), m) for f in rows._fields})


def _per_platform(run, z, cfg, cpu_differs=False):
    """run(on_cpu) for the platform the call is lowered for (``lax.platform_dependent``: a
    jitted function does not know its device while it is traced). The chunk and the row
    block differ (a CPU's are smaller) and so may the CPU's gradient carry; when none does,
    the one program is traced once."""
    if not cpu_differs and _plan(z, cfg, True) == _plan(z, cfg, False):
        return run(True)
    return lax.platform_dependent(cpu=lambda: run(True), default=lambda: run(False))


def tile(a, row0, rows, start, c):
    """Rows [row0, row0 + rows) and columns [start, start + c) of a [N, K] array (None: None)."""
    if a is None:
        return None
    # one index dtype: under jax_enable_x64 a loop's counter is int64, a row offset int32
    return lax.dynamic_slice(a, (jnp.int32(row0), jnp.int32(start)), (rows, c))


def _row_slice(x, row0, rows):
    return None if x is None else lax.dynamic_slice_in_dim(x, row0, rows, axis=0)


def _block(rows, row0, n):
    """The bundle's per-row fields of rows [row0, row0 + n); the logits stay whole (tiles are
    sliced from them, ``tile``)."""
    return rows._replace(**{f: _row_slice(getattr(rows, f), row0, n)
                            for f in ("targets", "active", "shift_ids", "shift")})


def in_loop(i, z, u):
    """z, u as seen from iteration i of a chunk loop or row ``i`` of the loop of row blocks
    (same values, no copy).

    XLA's CPU compiler does bfloat16 slicing in float32: it converts the *whole* operand,
    then hoists that conversion out of the loop as loop-invariant, so a bfloat16 call would
    hold a [N, K] float32 copy of the logits (forward at N 512, K 32768 on two cores: 26 ms;
    8 ms without the copy). Passing the operands through an optimization barrier together
    with the loop index makes them loop-variant, so each chunk converts only its own slice."""
    z, u, _ = lax.optimization_barrier((z, u, i))
    return z, u


def _is_half(dtype):
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def carry_dtype(dtype, on_cpu):
    """The gradient buffer's dtype in the backward loop: on CPU a 16-bit float gradient is
    carried as its uint16 bits. XLA's CPU compiler has no 16-bit float dynamic-update-slice:
    it would convert the *whole* [N, K] buffer to float32 and back at every chunk (forward +
    gradient at N 512, K 32768 on two cores: 160 ms, 51 ms with the bits). An integer update
    is native; the one bitcast at the end costs a copy of the gradient (a [N, K] temporary of
    the gradient's own 2 bytes per element). Other platforms update 16-bit floats natively."""
    return jnp.uint16 if on_cpu and _is_half(dtype) else dtype


def to_carry(g, dtype, carry):
    """A float32 gradient chunk in ``dtype``, bitcast to the carry's dtype when it differs."""
    g = g.astype(dtype)
    return g if carry == dtype else lax.bitcast_convert_type(g, carry)


def _from_carry(buf, dtype):
    return buf if buf.dtype == dtype else lax.bitcast_convert_type(buf, dtype)


def _block_partial(rows, target, cfg, offset, row0, nb, on_cpu):
    """(State, r_y, found) of [nb] float32 for rows [row0, row0 + nb): the chunk loop.
    ``target``: (found [N] bool, z_y [N]) of ``_targets``."""
    z, u = in_loop(row0, rows.logits, rows.teacher)  # loop-variant in the loop of blocks too
    k, c, n_chunks, _ = _plan(z, cfg, on_cpu)
    block = _block(rows, row0, nb)

    def body(i, state):
        z_i, u_i = in_loop(i, z, u)
        start = jnp.minimum(i * c, k - c)
        local = start + jnp.arange(c, dtype=jnp.int32)  # [C]
        cols = offset + local  # global column ids
        valid = stats_math.column_mask(xp, cols, cfg, local >= i * c)  # clamped last: skip seen
        chunk = block.columns(tile(z_i, row0, nb, start, c), tile(u_i, row0, nb, start, c))
        return tuple(stats_math.merge(xp, stats_math.State(*state),
                                      stats_math.chunk_partial(xp, chunk, cols, valid, cfg), cfg))

    # The first chunk is peeled so the loop carry starts from values that vary over the
    # same shard_map axes as the inputs (a constant initial state would not).
    cols = offset + jnp.arange(c, dtype=jnp.int32)
    first = stats_math.chunk_partial(
        xp, block.columns(tile(z, row0, nb, 0, c), tile(u, row0, nb, 0, c)), cols,
        stats_math.column_mask(xp, cols, cfg), cfg)
    state = stats_math.State(*lax.fori_loop(1, n_chunks, body, tuple(first)))
    # the target's logit (gathered before the blocks), its cap and shift in [nb]
    found, z_y = (_row_slice(x, row0, nb) for x in target)
    return (state, *stats_math.shifted_target(xp, z_y, found, block, cfg))


def _targets(rows, cfg, offset):
    """(found [N] bool, z_y [N] in the logits' dtype): whether this block of columns holds
    each row's target, and its logit (0 where not), one gather over all rows before the row
    blocks: inside their loop XLA's CPU compiler converted whole bfloat16 logits to float32
    for it (a [N, K] float32 temporary)."""
    found, idx = stats_math.target_column(xp, rows.targets, rows.logits.shape[1], offset, cfg)
    return found, xp.gather_cols(rows.logits, idx)


def _forward_rows(rows, cfg, offset, finish, n_out):
    """``finish(State, r_y, found, block)`` (a tuple of ``n_out`` [rows] float32) of every row
    block, assembled into ``n_out`` [N] float32 arrays."""
    n, least = rows.logits.shape[0], least_rows(rows.logits.shape[1], cfg)
    if n < least:
        out = _forward_rows(_padded_bundle(rows, least), cfg, offset, finish, n_out)
        return tuple(o[:n] for o in out)

    target = _targets(rows, cfg, offset)

    def run(on_cpu):
        def block(row0, nb):
            return finish(*_block_partial(rows, target, cfg, offset, row0, nb, on_cpu),
                          _block(rows, row0, nb))

        return fold_row_outputs(block, n, _plan(rows.logits, cfg, on_cpu)[3], least,
                                (jnp.float32,) * n_out, (rows, offset))

    return _per_platform(run, rows.logits, cfg)


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
        out = _forward_rows(rows, cfg, offset,
                            lambda state, r_y, found, block: (*state, r_y, found),
                            len(stats_math.State._fields) + 2)
        return stats_math.State(*out[:-2]), out[-2], out[-1]

    @staticmethod
    def forward(rows, cfg):
        # every row's statistics finalised in its own block (their exp and log in [rows])
        def finish(state, r_y, found, block):
            return tuple(stats_math.finalize(xp, state, r_y, found, block.active, cfg))

        return stats_math.Stats(*_forward_rows(rows, cfg, 0, finish,
                                               len(stats_math.Stats._fields)))

    @staticmethod
    def backward(rows, stats, grads, cfg, offset=0):
        # -> dz [N, K] in z's dtype, du [N, K] in u's dtype or None
        n, least = rows.logits.shape[0], least_rows(rows.logits.shape[1], cfg)
        if n < least:
            pad = lambda x: xp.pad_rows(x, least)  # noqa: E731
            dz, du = ChunkedJax.backward(_padded_bundle(rows, least),
                                         type(stats)(*map(pad, stats)),
                                         tuple(map(pad, grads)), cfg, offset)
            return dz[:n], (None if du is None else du[:n])
        z, u = rows.logits, rows.teacher

        def gradient(on_cpu):
            k, c, n_chunks, r = _plan(z, cfg, on_cpu)
            carry_z = carry_dtype(z.dtype, on_cpu)
            carry_u = None if u is None else carry_dtype(u.dtype, on_cpu)

            def block_step(carry, row0, nb):
                z_b, u_b = in_loop(row0, z, u)  # loop-variant in the loop of blocks too
                block = _block(rows, row0, nb)
                block_stats = type(stats)(*(_row_slice(s, row0, nb) for s in stats))
                block_grads = tuple(_row_slice(g, row0, nb) for g in grads)

                def body(i, carry):
                    dz, du = carry
                    z_i, u_i = in_loop(i, z_b, u_b)
                    start = jnp.minimum(i * c, k - c)
                    cols = offset + start + jnp.arange(c, dtype=jnp.int32)
                    chunk = block.columns(tile(z_i, row0, nb, start, c),
                                          tile(u_i, row0, nb, start, c))
                    gz, gu = stats_math.chunk_grads(xp, chunk, cols, block_stats, block_grads,
                                                    cfg)
                    update = lambda buf, g, dtype, carry: lax.dynamic_update_slice(
                        buf, to_carry(g, dtype, carry), (jnp.int32(row0), jnp.int32(start)))
                    dz = update(dz, gz, z.dtype, carry_z)
                    if du is not None:
                        du = update(du, gu, u.dtype, carry_u)
                    return dz, du

                # peeled first chunk: the carry then varies like the inputs under shard_map
                return lax.fori_loop(1, n_chunks, body, body(0, carry))

            like = (rows, stats, grads, offset)
            du0 = varying_like(jnp.zeros(u.shape, carry_u), *like) if cfg.TEACHER_GRAD else None
            dz0 = varying_like(jnp.zeros(z.shape, carry_z), *like)
            dz, du = fold_row_blocks(block_step, n, r, (dz0, du0), least)
            return _from_carry(dz, z.dtype), (None if du is None else _from_carry(du, u.dtype))

        half = _is_half(z.dtype) or (cfg.TEACHER_GRAD and _is_half(u.dtype))
        return _per_platform(gradient, z, cfg, cpu_differs=half)


IMPLEMENTATION = ChunkedJax()
