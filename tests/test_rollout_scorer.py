"""Rollout = trainer (docs/design.md §3): the denoising step's log-probability of the token it
draws and its entropy are, bit for bit, what the scorer (``per_token_logps(...,
return_entropy=True)``, ``token_stats`` with the step's ``chunk_size``) returns for that token
on the same logits, framework and backend, so the importance ratio of an on-policy update is
exactly 1; and ``get_transfer_index``'s confidence is the scorer's probability at T = 1.

Every backend of both frameworks (the Triton kernels in their interpreter, JAX's through the
jax-triton emulator; the Pallas kernels in interpret mode), at an awkward shape (K = 37, not a
multiple of any chunk; a chunk_size of 16 gives three chunks, the last ragged), float32 and
bfloat16 logits, temperatures 0.7, 1, 1e-3 and 0 (greedy: the statistics at T = 1), from
logits and from a LinearHead. The comparisons are of the float32 bit patterns (-0 is not 0).
Both JAX calls run under ``jax.jit``, as a rollout and a training step do; one test runs both
op by op. JAX (a compile per configuration) and the interpreted kernels (one program per row,
each call traced anew) take fewer cases; the kernels fewer rows too."""

from __future__ import annotations

import numpy as np
import pytest

from harness import framework
from triton_marks import needs_interpreter

SHAPE = (3, 5, 37)  # [B, L, K]
KERNEL_SHAPE = (2, 3, 37)
TORCH = [("torch", "reference"), ("torch", "chunked")]
JAX = [("jax", "reference"), ("jax", "chunked")]
KERNELS = [("torch", "triton"), ("jax", "pallas"), ("jax", "triton")]
#: (logits dtype, temperature of the draw, chunk_size): T = 0 draws greedily and takes the
#: statistics at T = 1; with a chunk_size the scorer is token_stats with the same one
CASES = [("float32", 0.7, None), ("bfloat16", 1.0, 16), ("float32", 1e-3, 16),
         ("bfloat16", 0.0, None)]


def _params(pairs, cases):
    """pytest params (framework, backend, *case); the Triton kernels only where they run."""
    return [pytest.param(fw, backend, *case,
                         marks=[needs_interpreter] if backend == "triton" else [])
            for fw, backend in pairs for case in cases]


@pytest.fixture
def fw_backend(request, fw_name, backend):
    """(framework adapter, backend name); JAX's triton backend against the emulator."""
    if (fw_name, backend) == ("jax", "triton"):
        request.getfixturevalue("jax_triton_on_cpu")
    return framework(fw_name), backend


def _bits(fw, x):
    """The float32 bit patterns of x (a framework array) as NumPy uint32."""
    if fw.name == "torch":
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, np.float32).view(np.uint32)


def _jit(fw, fn, jit=True):
    return fw.jax.jit(fn) if fw.name == "jax" and jit else fn


def _batch(fw, tokens):
    api = fw.api
    weights = fw.array(np.ones(tokens.shape, np.float32))
    ids = tokens.long() if fw.name == "torch" else tokens
    return api.DiffusionTokenBatch(model_inputs=ids, target_ids=ids, loss_weights=weights)


def _scorer(fw, backend, temperature, chunk_size):
    """logits, tokens -> (logp, entropy) of the tokens: per_token_logps, or token_stats where
    a chunk_size is given (per_token_logps takes none)."""
    api = fw.api

    def score(logits, tokens):
        if chunk_size is None:
            return api.per_token_logps(logits, _batch(fw, tokens), temperature=temperature,
                                       return_entropy=True, backend=backend)
        stats = api.token_stats(logits, tokens, temperature=temperature, chunk_size=chunk_size,
                                backend=backend)
        return stats.logp, stats.entropy

    return score


def _check_step_is_scorer(fw, backend, logits, temperature, chunk_size, jit=True, **kw):
    """The step's Sample of logits (``kw``: more of sample_tokens' arguments), after checking
    its logp and entropy against the scorer's bits."""
    api = fw.api
    kw = dict(dict(seed=11, step=3), **kw)
    step = _jit(fw, lambda z: api.sample_tokens(z, temperature=temperature,
                                                chunk_size=chunk_size, backend=backend, **kw),
                jit)
    sample = step(logits)
    tokens = sample.token
    assert np.all(np.asarray(fw.numpy(tokens)) >= 0)  # every row has a valid draw
    t_stats = kw.get("stats_temperature") or temperature or 1.0
    logp, entropy = _jit(fw, _scorer(fw, backend, t_stats, chunk_size), jit)(logits, tokens)
    for name, got, want in (("logp", sample.logp, logp), ("entropy", sample.entropy, entropy)):
        g, w = _bits(fw, got), _bits(fw, want)
        bad = np.flatnonzero(g != w)
        assert bad.size == 0, (
            f"{name}: {bad.size} of {g.size} rows differ from the scorer's bits, first at "
            f"{bad[0]}: {g.reshape(-1)[bad[0]].view(np.float32)!r} vs "
            f"{w.reshape(-1)[bad[0]].view(np.float32)!r}")
    return sample


@pytest.mark.parametrize("fw_name,backend,dtype,temperature,chunk_size",
                         _params(TORCH, CASES) + _params(JAX, CASES[1:3])
                         + _params(KERNELS, CASES[1:2]))
def test_step_logp_and_entropy_are_the_scorers(rng, fw_backend, dtype, temperature,
                                                chunk_size):
    fw, backend = fw_backend
    shape = KERNEL_SHAPE if (fw.name, backend) in KERNELS else SHAPE
    logits = fw.array(rng.normal(size=shape) * 3.0, dtype)
    _check_step_is_scorer(fw, backend, logits, temperature, chunk_size)


@pytest.mark.parametrize("fw_name,backend", [("jax", "chunked")])
def test_op_by_op(rng, fw_backend):
    """Both JAX calls op by op (outside jax.jit), in three chunks."""
    fw, backend = fw_backend
    logits = fw.array(rng.normal(size=SHAPE) * 3.0, "bfloat16")
    _check_step_is_scorer(fw, backend, logits, 0.9, 16, jit=False)


@pytest.mark.parametrize("fw_name,backend", [("torch", "chunked")])
def test_torch_cpu_row_blocks(rng, fw_backend, monkeypatch):
    """Wider rows than a chunk: torch's CPU schedule cuts these 130 rows into row blocks of 64
    (the last of 2) whose vocabulary chunks differ in width, run on two single-threaded
    workers; the step's own chunks differ from all of them."""
    from dlm_kernels.token_stats import torch_row_blocks

    monkeypatch.setattr(torch_row_blocks, "WORKER_ELEMENTS", 1 << 16)  # two workers
    fw, backend = fw_backend
    logits = fw.array(rng.normal(size=(2, 65, 8200)) * 4.0, "bfloat16")
    _check_step_is_scorer(fw, backend, logits, 0.9, None)


@pytest.mark.parametrize("fw_name,backend", [("torch", "chunked")])
def test_torch_cpu_compiled_tiles(rng, fw_backend, monkeypatch, torch_config):
    """Where torch's CPU schedule runs compiled tiles (``token_stats.torch_compiled``, here at
    every size), the step's statistics are still the forward's."""
    from dlm_kernels.token_stats import torch_compiled

    monkeypatch.setattr(torch_compiled, "COMPILE_MIN_VOCAB", 0)
    torch_config("torch._dynamo.config", recompile_limit=64)
    fw, backend = fw_backend
    logits = fw.array(rng.normal(size=SHAPE) * 3.0, "float32")
    _check_step_is_scorer(fw, backend, logits, 0.7, None)


@pytest.mark.parametrize("fw_name,backend,temperature",
                         _params(TORCH, [(0.0,), (0.7,)]) + _params(JAX, [(0.7,)])
                         + _params(KERNELS, [(0.0,)]))
def test_transfer_confidence_is_the_scorers_probability(rng, fw_backend, temperature):
    """get_transfer_index's confidence is exp of the drawn token's logp at T = 1 (greedy, or
    the step's statistics at their own temperature beside a draw at 0.7): a threshold set to
    the scorer's probability of one masked position per sequence (exp of per_token_logps at
    T = 1, in the framework) commits exactly the masked positions whose scorer probability
    reaches it, that position included (an ulp less would leave it). Some rows have a
    dominant logit (probabilities that round to 1 and to 0), some a two-way tie at the top."""
    fw, backend = fw_backend
    api = fw.api
    b, length, _ = shape = KERNEL_SHAPE if (fw.name, backend) in KERNELS else SHAPE
    z = rng.normal(size=shape) * 3.0
    z[0, :2, 3] = 40.0  # peaked rows: p = 1 in float32, the rest below its resolution
    z[1, :2, 7] = z[1, :2, 8] = 9.0  # a two-way tie at the top
    logits = fw.array(z, "float32")
    masked_np = rng.random((b, length)) < 0.7
    masked_np[:, 0] = True
    mask = fw.array(masked_np)
    x = fw.array(np.full((b, length), 99, np.int32))
    kw = dict(seed=7, step=1)
    sample = _check_step_is_scorer(fw, backend, logits, temperature, None,
                                   stats_temperature=None if temperature == 0.0 else 1.0, **kw)
    exp = fw.torch.exp if fw.name == "torch" else fw.jnp.exp
    score = _jit(fw, lambda z, t: exp(_scorer(fw, backend, 1.0, None)(z, t)[0]))
    conf = np.asarray(fw.numpy(score(logits, sample.token)))  # float32 values
    pick = [np.flatnonzero(masked_np[i])[len(np.flatnonzero(masked_np[i])) // 2]
            for i in range(b)]
    threshold = conf[np.arange(b), pick]  # float32 values, exact in float64
    run = _jit(fw, lambda z, m, x, thr: api.get_transfer_index(
        z, temperature, "low_confidence", m, x, None, threshold=thr, backend=backend, **kw))
    x0, transfer = run(logits, mask, x, fw.array(threshold.astype(np.float32)))
    x0, transfer = np.asarray(fw.numpy(x0)), np.asarray(fw.numpy(transfer))
    tokens = np.asarray(fw.numpy(sample.token))
    assert np.array_equal(x0[masked_np], tokens[masked_np])  # the same draw
    want = masked_np & (conf >= threshold[:, None])
    assert want[np.arange(b), pick].all()
    assert np.array_equal(transfer, want), (transfer, want)


@pytest.mark.parametrize("fw_name,backend", JAX)
@pytest.mark.parametrize("shape", [SHAPE, (16, 8, 37)])
def test_jax_threshold_at_every_scorer_probability(rng, fw_backend, shape):
    """get_transfer_index reads the step's logp alone: under jax.jit XLA dropped the entropy
    its loop of row blocks carried, and the rest compiled to other bits, so exp(logp) sat an
    ulp below the scorer's probability (one input in 20 at [3, 5, 37]; at [16, 8, 37], 128
    rows, every input of the reference, whose blocks of 8 rows then compiled unlike the
    scorer's 128). The step's logp and entropy are the scorer's bits at both shapes, and
    get_transfer_index and commit_tokens with confidence="probability", at a threshold set
    to the scorer's probability of each masked position in turn, commit exactly the masked
    positions whose scorer probability reaches it (``inclusive=True``: upstream's >=)."""
    fw, backend = fw_backend
    api, jax, jnp = fw.api, fw.jax, fw.jnp
    b, length, _ = shape
    logits = fw.array(rng.normal(size=shape) * 3.0, "float32")
    masked_np = rng.random((b, length)) < 0.7
    masked_np[:, 0] = True
    mask, x = fw.array(masked_np), fw.array(np.full((b, length), 99, np.int32))
    kw = dict(seed=5, step=2)
    sample = _check_step_is_scorer(fw, backend, logits, 0.7, None, stats_temperature=1.0, **kw)
    conf = np.asarray(_jit(fw, lambda z, t: jnp.exp(_scorer(fw, backend, 1.0, None)(z, t)[0]))(
        logits, sample.token))
    transfer = jax.jit(lambda z, m, x, thr: api.get_transfer_index(
        z, 0.7, "low_confidence", m, x, None, threshold=thr, backend=backend, **kw)[1])
    commit = jax.jit(lambda z, m, thr: api.commit_tokens(
        x, api.sample_tokens(z, temperature=0.7, stats_temperature=1.0, backend=backend, **kw),
        m, rule="threshold", threshold=thr, inclusive=True)[1])
    for j in range(length):
        threshold = np.where(masked_np[:, j], conf[:, j], 2.0).astype(np.float32)
        want = masked_np & (conf >= threshold[:, None])
        want[~masked_np[:, j]] = False  # a threshold of 2 commits nothing ...
        none = ~want.any(axis=1)  # ... but the surest masked position (at least one)
        want[none, np.argmax(np.where(masked_np, conf, -1.0), axis=1)[none]] = True
        thr = fw.array(threshold)
        for name, got in (("get_transfer_index", transfer(logits, mask, x, thr)),
                          ("commit_tokens", commit(logits, mask, thr))):
            got = np.asarray(got)
            bad = np.argwhere(got != want)
            assert bad.size == 0, (f"{name}, threshold at column {j}: first wrong at "
                                   f"{tuple(bad[0])} (committed {got[tuple(bad[0])]})")


@pytest.mark.parametrize("fw_name,backend", TORCH + JAX[1:])
def test_linear_head(rng, fw_backend):
    """From a LinearHead(h, W) over token chunks of 4 rows, float32: torch's last chunk
    ragged, JAX's the last 4 rows (the head paths' own token chunks), the reference's logits
    whole in float32, as the token statistics take them."""
    fw, backend = fw_backend
    api = fw.api
    layout = api.LinearHead.DEFAULT_LAYOUT
    h = rng.normal(size=SHAPE[:2] + (19,))
    w = rng.normal(size=(SHAPE[2], 19))  # [K, D]
    head = api.LinearHead(fw.array(h, "float32"), fw.array(w if layout == "KD" else w.T,
                                                           "float32"), row_chunk=4)
    _check_step_is_scorer(fw, backend, head, 0.8, None)


@pytest.mark.parametrize("fw_name,backend", [("torch", "chunked")])
def test_torch_chunked_one_chunk_loop(rng, fw_backend, monkeypatch):
    """Where the chunked token statistics stream whole rows in one chunk loop (on an
    accelerator, and under tracing; here forced on CPU tensors), the step streams the same
    chunks and takes the statistics in its own pass: K = 300 in chunks of 128."""
    from dlm_kernels.token_stats import torch_chunked

    monkeypatch.setattr(torch_chunked, "use_row_blocks", lambda z: False)
    fw, backend = fw_backend
    logits = fw.array(rng.normal(size=(2, 5, 300)) * 3.0, "bfloat16")
    _check_step_is_scorer(fw, backend, logits, 0.6, None)
    _check_step_is_scorer(fw, backend, logits, 0.6, 128)
