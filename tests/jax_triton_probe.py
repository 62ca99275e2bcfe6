"""Lower the JAX triton backend for CUDA through the real jax-triton, on a machine without a
GPU: jax-triton's own specialisation and typing of every launch, and Triton's compile of each
kernel to PTX, short of running it.

Needs jax-triton and a GPU-enabled jaxlib plugin beside a CPU jaxlib (no GPU, no CUDA
libraries: lowering only compiles the kernels). For the H200 image (Python 3.12, jax 0.11.2,
Triton 3.6):

    pip install "jax==0.11.2" "jaxlib==0.11.2" "triton==3.6.0" absl-py
    pip install --no-deps "jax-cuda13-plugin==0.11.2" "jax-triton==0.3.1"
    JAX_PLATFORMS=cpu python tests/jax_triton_probe.py

jax-triton reads the compute capability off device 0; it is given as 90 (an H200) here.
Prints one JSON line {"plain_triton_compile_error": None or why a plain triton.compile fails
in this process, case: {"kernels": launches lowered, "f64_ops": float64 instructions in
their PTX besides the narrowing of an argument, "vector_loads": {kernel: 16-byte loads in
its PTX}, "error": ...}}; exit 3 when jax-triton or the plugin does not import.
``token_stats/test_triton.py::test_real_jax_triton_lowers_for_cuda`` runs it.
"""

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # triton.jit must make compilable functions
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # a mesh for shard_map

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

try:
    import jax_triton as jt
    from jax_triton import triton_lib
    from jax._src.lib import gpu_triton

    assert gpu_triton.TritonKernel is not None
except Exception as err:  # noqa: BLE001 - ImportError, or no GPU plugin in this jaxlib
    print(f"no real jax-triton with a GPU-enabled jaxlib here: {err!r}")
    sys.exit(3)

import dlm_kernels.jax as dk  # noqa: E402
from aot_probe import F64_OP, VECTOR_LOAD  # noqa: E402 - this folder
from dlm_kernels.token_stats import jax_triton as backend
from dlm_kernels.sampling import jax_triton as sampler  # noqa: E402

PTX = []  # (kernel name, PTX) of every kernel compiled by the current case


def _capture(compile_fn):
    def wrapped(*args, **kwargs):
        result = compile_fn(*args, **kwargs)
        PTX.append((result.name, result.binary))
        return result

    return wrapped


def cases(rng):
    """(name, fn, args[, launches]): each fn (differentiated where it has a gradient) is
    jitted and lowered for CUDA; ``launches``: the jax-triton calls expected, 3 when not
    given (partial, finalize, gradient)."""
    n, k = 6, 1271  # K unaligned, several row blocks
    z = lambda dtype, *rows: jnp.asarray(rng.normal(size=rows + (k,)) * 3, dtype)
    y = jnp.asarray(rng.integers(0, k, (n,)), jnp.int32)
    w = jnp.asarray((rng.uniform(size=(n,)) < 0.7).astype(np.float32))
    x = jnp.asarray(rng.integers(0, k, (n,)), jnp.int32)
    d = jnp.asarray(rng.uniform(0, 3, (n,)), jnp.float32)
    every = dict(temperature=0.7, ce_temperature=1.0, softcap=30.0, shift_ids=x, shift=d,
                 teacher_temperature=1.3)

    def stats_loss(**kw):
        def fn(zz, uu):
            s = dk.token_stats(zz, y, w, teacher_logits=uu, backend="triton", **kw)
            return s.lse.sum() + s.logp.sum() + s.entropy.sum() + s.kl.sum()
        return jax.grad(fn, argnums=(0, 1))

    for dtype in ("bfloat16", "float16", "float32"):
        yield (f"every feature, teacher gradient, {dtype}", stats_loss(teacher_grad=True, **every),
               (z(dtype, n), z(dtype, n)))
    yield ("T = 1 everywhere (scalars equal to 1 become constexprs)", stats_loss(),
           (z("bfloat16", n), z("bfloat16", n)))
    yield ("split-K blocks of 128 columns", stats_loss(chunk_size=128, **every),
           (z("bfloat16", n), z("bfloat16", n)))
    one = lambda f: jax.grad(lambda zz: f(zz).sum())
    yield ("one row", one(lambda zz: dk.token_stats(zz, y[:1], backend="triton").logp),
           (z("bfloat16", 1),))
    batch = dk.DiffusionTokenBatch.create(model_inputs=y[None], target_ids=y[None],
                                          loss_weights=w[None])
    yield ("weighted_cross_entropy",
           jax.grad(lambda zz: dk.weighted_cross_entropy(zz, batch, backend="triton").compute()),
           (z("bfloat16", 1, n),))
    yield ("per_token_logps with entropy", jax.grad(lambda zz: sum(
        v.sum() for v in dk.per_token_logps(zz, batch, temperature=0.7, stop_gradient=False,
                                            return_entropy=True, backend="triton"))),
           (z("bfloat16", 1, n),))
    dbatch = dk.DiffusionDistillationBatch.create(student_batch=batch,
                                                  teacher_logits=z("bfloat16", 1, n))
    yield ("opd_loss", jax.grad(lambda zz: dk.opd_loss(
        zz, dbatch, temperature=2.0, hard_loss_weight=0.1, backend="triton")[0].compute()),
           (z("bfloat16", 1, n),))
    wide = lambda dtype: jnp.asarray(rng.normal(size=(n, 4096)), dtype)
    yield ("K = 4096: rows start 16-byte aligned", stats_loss(teacher_grad=True),
           (wide("bfloat16"), wide("bfloat16")))
    yield ("vmap over a batch axis (folded into rows)", jax.vmap(one(
        lambda zz: dk.token_stats(zz, y, w, backend="triton", **every).logp)),
           (z("bfloat16", 3, n),))
    big = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((16384, 262144), jnp.bfloat16), ((16384, 262144), jnp.bfloat16),
        ((16384,), jnp.int32), ((16384,), jnp.float32))]  # traced, never allocated

    def target_shape_loss(zz, uu, yy, ww):
        s = dk.token_stats(zz, yy, ww, teacher_logits=uu, temperature=2.0, ce_temperature=1.0,
                           entropy=False, backend="triton")
        return s.logp.sum() + s.kl.sum()

    yield ("the target shape, N 16384, K 262144 (N·K > 2^31), distillation",
           jax.grad(target_shape_loss), big)
    sup = jnp.asarray([0, 7], jnp.int32)
    yield ("sample_tokens: draw with guidance and suppressed ids (one launch)",
           lambda zz, uu: dk.sample_tokens(zz, uncond_logits=uu, cfg_scale=1.5, temperature=0.8,
                                           suppress_ids=sup, seed=3, step=1, backend="triton"),
           (z("bfloat16", n), z("bfloat16", n)), 1)
    yield ("sample_tokens: top-k at T = 1 (a constexpr 1), vmapped",
           jax.vmap(lambda zz: dk.sample_tokens(zz, top_k=8, backend="triton").token),
           (z("bfloat16", 3, n),), 1)
    yield ("sample_tokens: greedy at the target shape, N 16384, K 262144",
           lambda zz: dk.sample_tokens(zz, temperature=0.0, backend="triton"), big[:1], 1)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "vocab"))

    def shard_loss(zz, yy, ww):  # zz: [B/2, L, K/2] on each device, padded vocabulary
        b = dk.DiffusionTokenBatch.create(model_inputs=yy, target_ids=yy, loss_weights=ww)
        with dk.vocab_parallel("vocab", vocab_size=k - 3):
            ws = dk.weighted_cross_entropy(zz, b, backend="triton")
        return jax.lax.psum(ws.unreduced_sum, "data") / jax.lax.psum(ws.denominator, "data")

    sharded = jax.shard_map(shard_loss, mesh=mesh, out_specs=P(),
                            in_specs=(P("data", None, "vocab"), P("data"), P("data")))
    yield ("vocabulary-parallel under shard_map (traced column offset; no finalize)",
           jax.value_and_grad(sharded),
           (jnp.asarray(rng.normal(size=(2, n, 2 * 640)), jnp.bfloat16),
            jnp.stack([y, y[::-1]]) % (k - 3), jnp.stack([w, w[::-1]])), 2)


def plain_triton_compile():
    """None, or why a plain ``triton.compile`` (what the torch backend's kernels, Liger and
    torch.compile do) fails in this process once jax-triton and the JAX backend are loaded:
    jax-triton 0.3.1 blanks TRITON_CACHE_DIR on import; the backend must undo that."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def copy_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs))

    src = ASTSource(fn=copy_kernel, signature={"src_ptr": "*fp32", "dst_ptr": "*fp32",
                                               "BLOCK": "constexpr"}, constexprs={"BLOCK": 128})
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except Exception as err:  # noqa: BLE001 - reported, the test fails on it
        return f"{type(err).__name__}: {err}"
    return None


def main():
    triton_lib.triton_kernel_call_lib.get_compute_capability = lambda device: 90
    triton_lib.compile_ttir_inplace = _capture(triton_lib.compile_ttir_inplace)
    backend.TritonJax.unsupported_reason = staticmethod(lambda platform: None)  # CPU arrays
    sampler.TritonSampler.unsupported_reason = staticmethod(lambda platform: None)
    report = {"versions": dict(jax=jax.__version__, jax_triton=jt.__version__,
                               triton=__import__("triton").__version__),
              "plain_triton_compile_error": plain_triton_compile()}
    for name, fn, args, *launches in cases(np.random.default_rng(0)):
        PTX.clear()
        getattr(triton_lib, "_COMPILED_KERNEL_CACHE", {}).clear()  # 0.3: compile every case
        entry = {"expected": launches[0] if launches else 3}
        try:
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            entry["kernels"] = text.count("triton_kernel_call")
        except Exception as err:  # noqa: BLE001 - reported, the test fails on it
            entry["error"] = f"{type(err).__name__}: {err}"[-2000:]
        entry["compiled"] = len(PTX)
        entry["f64_ops"] = sum(len(F64_OP.findall(ptx)) for _, ptx in PTX)
        entry["vector_loads"] = {kernel: len(VECTOR_LOAD.findall(ptx)) for kernel, ptx in PTX}
        report[name] = entry
    print(json.dumps(report))


if __name__ == "__main__":
    main()
