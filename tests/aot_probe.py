"""Compile the Triton kernels for sm_90 on any machine and report spills and registers.

Usage: python aot_probe.py DTYPE(bf16|fp16|fp32) TEACHER(0|1). Prints one JSON line
{kernel: {registers, spill_stores, spill_loads, vector_loads, vector_stores, slow_exps,
sass_per_logit, loop_barriers, row_offsets, narrow_row_offsets, rounded_narrowings,
other_narrowings}}; exit 3 when
ptxas is unavailable. Compiles at the configuration launched for N = 16384, K = 262144,
specialised as the launch specialises it: Triton marks every pointer (16-byte aligned
allocations) and every integer argument divisible by 16 with tt.divisibility = 16, which is
what lets the unmasked main loops use 16-byte accesses, and types every integer under 2^31
as i32 (row strides included: the kernels must widen row offsets themselves, which
"narrow_row_offsets" counts the failures of, from the TTIR). Every kernel is compiled with every
feature on (the register worst case; keys "stats_*_kernel[...]"), and the two streaming
kernels once more as the objectives launch them (keys "objective:..."): weighted CE (no
teacher, no entropy) or, with TEACHER=1, distillation (teacher, T = 1 CE beside the
T-scaled KL, no entropy). Keys "jax:...": the streaming and finalize kernels typed and
specialised as jax-triton 0.3 launches them (see below), with "f64_ops" counting float64
arithmetic in every kernel. Keys "sampler:MODE:..." (and "jax:sampler:draw:..."), for bf16 with TEACHER=0: the
denoising step's kernel, greedy, drawing and top-k, with guidance and suppressed ids;
"approx_divs" / "approx_logs" count float32 divisions that are not correctly rounded and
approximate logs (a token decision must compute s = z / T and the noise's logs as the host
does).
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dlm_kernels.kernels.triton import sampling as SAMPLER
from dlm_kernels.kernels.triton import token_stats as K

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_launch import (VOCAB, finalize_kernel, ptxas_or_exit, stats_arg_types,  # noqa: E402
                         stats_launch_ints, streaming_kernels)

ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# PTX instructions: 16-byte (or 8-byte) global loads and stores; float64 instructions other
# than the narrowing of a float64 argument (cvt.rn.f32.f64)
VECTOR_LOAD = re.compile(r"ld\.global(?:\.\w+)*\.v[24]\.")
VECTOR_STORE = re.compile(r"st\.global(?:\.\w+)*\.v[24]\.")
F64_OP = re.compile(r"^\s*(?!cvt\.)[a-z][\w.]*\.f64\b", re.M)
# TTIR: a pointer broadcast to a block, and pointer arithmetic with its offset's integer type
SPLAT = re.compile(r"(%[\w.]+) = tt\.splat (%[\w.]+)\b")
ADDPTR = re.compile(r"= tt\.addptr (%[\w.]+), %[\w.]+ : [^,]+, (?:tensor<[\dx]*)?(i\d+)")
NK_POINTERS = ("%z_ptr", "%u_ptr", "%dz_ptr", "%du_ptr", "%zu_ptr")  # the [N, K] arrays
# PTX: float32 division or log that is not correctly rounded / not libdevice's precise one
APPROX_DIV = re.compile(r"div\.(?:full|approx)(?:\.ftz)?\.f32")
APPROX_LOG = re.compile(r"lg2\.approx")
# PTX narrowing of float32 to a 16-bit float: to nearest (cvt.rn) or any other rounding
NARROW_RN = re.compile(r"cvt\.rn\.(?:bf16|f16)(?:x2)?\.f32")
NARROW_OTHER = re.compile(r"cvt\.r[zmp]\.(?:bf16|f16)(?:x2)?\.f32")


def row_offsets(ttir):
    """(offsets added to an [N, K] argument pointer, how many of them are narrower than 64
    bits). Row r of an [N, K] array starts r·stride elements in, past 2^31 once N·K is; the
    kernels add that offset to the argument pointer itself (the columns, below K, follow as
    32-bit offsets from the row's pointer), so every one of these must be int64."""
    bases = set(NK_POINTERS)
    for m in SPLAT.finditer(ttir):
        if m.group(2) in bases:
            bases.add(m.group(1))
    widths = [m.group(2) for m in ADDPTR.finditer(ttir) if m.group(1) in bases]
    return len(widths), sum(w != "i64" for w in widths)


def ptxas_report(ptx, ptxas):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    grab = lambda pat: sum(int(v) for v in re.findall(pat, log))
    regs = [int(v) for v in re.findall(r"Used (\d+) registers", log)]
    return dict(registers=max(regs) if regs else 0, spill_stores=grab(r"(\d+) bytes spill stores"),
                spill_loads=grab(r"(\d+) bytes spill loads"))


def main_loop_sass(cubin, nvdisasm, elems_per_thread):
    """(SASS instructions per logit, barriers) in the first loop of the kernel (the unmasked
    whole-block loop of the streaming kernels): the issue cost the bandwidth has to hide,
    and the block-wide synchronisations in it. (None, None) without nvdisasm or a loop."""
    if not os.path.exists(nvdisasm):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    finally:
        os.unlink(f.name)
    labels = {m.group(1): i for i, line in enumerate(sass)
              if (m := re.match(r"^(\.L_x_\d+):", line.strip()))}
    for i, line in enumerate(sass):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:  # a backward branch closes a loop
            body = [x for x in sass[labels[m.group(1)]:i + 1] if re.search(r"/\*[0-9a-f]+\*/", x)]
            return round(len(body) / elems_per_thread, 1), sum("BAR" in x for x in body)
    return None, None


def main():
    dtype, teacher = sys.argv[1], bool(int(sys.argv[2]))
    ptxas = ptxas_or_exit()  # the ptxas triton itself uses for sm_90 (its PTX targets sm_90a)
    nvdisasm = os.path.join(os.path.dirname(ptxas), "nvdisasm")
    block_k = int(sys.argv[3]) if len(sys.argv) > 3 else None
    cfg = K.launch_config(VOCAB, ELEM_BYTES[dtype], teacher, block_k=block_k)
    flags = dict(HAS_SOFTCAP=True, HAS_SHIFT=True, HAS_TEACHER=teacher, SEPARATE_CE=True,
                 HAS_ENTROPY=True)
    objective = dict(HAS_SOFTCAP=False, HAS_SHIFT=False, HAS_TEACHER=teacher,
                     SEPARATE_CE=teacher, HAS_ENTROPY=False)
    ptr = f"*{dtype}"
    types = stats_arg_types(ptr)
    values = stats_launch_ints(cfg, 16384)
    # every feature on includes label smoothing's Σ r (SMOOTH) and the CE term's per-row
    # coefficients (CE_TERMS); the objectives' launches leave them at their defaults
    finalize = finalize_kernel(flags)
    kernels = [("", types, k) for k in streaming_kernels(cfg, flags, teacher) + [
        finalize, finalize_kernel(flags, smooth=False)]]
    kernels += [("objective:", types, k)
                for k in streaming_kernels(cfg, objective, False, ce=False)]
    # The JAX launch as jax-triton 0.3 (the version for the H200 image's Triton 3.6) types
    # it: a Python float as fp64, an integer by its value (i32 here), a scalar equal to 1 as
    # the constexpr 1 (the objectives' T = 1), token ids int32; it marks pointers as 16-byte
    # aligned but no integer as divisible by 16. Every feature on, at T = 1.
    jax_types = dict(types, x_ptr="*i32", y_ptr="*i32", inv_t="fp64", inv_t_ce="fp64",
                     inv_t_kl="fp64", softcap="fp64")
    at_t1 = dict(inv_t=1, inv_t_ce=1, inv_t_kl=1)
    kernels += [("jax:", jax_types, (fn, dict(c, **{k: v for k, v in at_t1.items()
                                                    if k in fn.arg_names}), w))
                for fn, c, w in streaming_kernels(cfg, flags, teacher) + [finalize]]
    # The sampler, every input on (guidance, suppressed ids): greedy, Gumbel draw, top-k; and
    # the draw as jax-triton types it (float64 scalars)
    sampler_types = dict(types, zu_ptr=ptr, keys_ptr="*i32", sup_ptr="*i64", n_suppress="i32",
                         stride_zu="i32", temperature="fp32", stat_temperature="fp32",
                         cfg_c="fp32", inv_t="fp32", state_ptr="*fp32",
                         ids_ptr="*i32", topv_ptr="*fp32", topi_ptr="*i32")
    values.update(stride_zu=VOCAB, n_suppress=1)
    plan = K.launch_config(VOCAB, ELEM_BYTES[dtype], True, block_k=block_k)
    sampler = lambda greedy, top_k, two_t=False: (SAMPLER.sample_partial_kernel, dict(
        GREEDY=greedy, TWO_T=two_t, HAS_UNCOND=True, HAS_SUPPRESS=True, TOP_K=top_k,
        TOP_KP=SAMPLER.slot_count(top_k), BLOCK_K=plan["block_k"], VEC=plan["vec"],
        ROWS_ALIGNED=True), plan["num_warps"])
    if not teacher and dtype == "bf16":  # the sampler reads no teacher: compiled once
        # "draw" with the statistics at their own temperature (stats_temperature: two
        # divisions per logit), the superset of the plain draw, which JAX's launch compiles
        kernels += [(f"sampler:{mode}:", sampler_types, sampler(greedy, top_k, two_t))
                    for mode, greedy, top_k, two_t in (("greedy", True, 0, False),
                                                       ("draw", False, 0, True),
                                                       ("top_k", False, 8, False))]
        kernels += [("jax:sampler:draw:", dict(sampler_types, sup_ptr="*i32",
                                               temperature="fp64", stat_temperature="fp64",
                                               cfg_c="fp64", inv_t="fp64"),
                     sampler(False, 0))]
    report = {}
    for prefix, typed, (fn, constexprs, warps) in kernels:
        # every parameter is typed here or a constexpr given above (a KeyError otherwise)
        sig = {name: "constexpr" if name in constexprs else typed[name] for name in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if sig[name].startswith("*")
                 or (prefix != "jax:" and values.get(name, 1) % 16 == 0)}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        options = dict(num_warps=warps, num_stages=cfg["num_stages"])
        if "sampler:" in prefix:  # launched so (guidance's multiply and add round apart)
            options["enable_fp_fusion"] = False
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = compiled.asm["ptx"]
        block = constexprs.get("BLOCK_K", "smooth" if constexprs.get("SMOOTH") else "plain")
        key = f"{prefix}{fn.__name__}[{block}]"
        streaming = "BLOCK_K" in constexprs
        per_logit, barriers = (main_loop_sass(compiled.asm["cubin"], nvdisasm,
                                              constexprs["BLOCK_K"] // (32 * warps))
                               if streaming else (None, None))
        offsets, narrow = row_offsets(compiled.asm["ttir"])
        report[key] = dict(
            ptxas_report(ptx, ptxas), num_warps=warps,
            row_offsets=offsets, narrow_row_offsets=narrow,
            rounded_narrowings=len(NARROW_RN.findall(ptx)),
            other_narrowings=len(NARROW_OTHER.findall(ptx)),
            vector_loads=len(VECTOR_LOAD.findall(ptx)),
            vector_stores=len(VECTOR_STORE.findall(ptx)),
            # tl.exp's ex2 without .ftz drags a subnormal fix-up along (3 more instructions)
            slow_exps=len(re.findall(r"ex2\.approx\.f32", ptx)),
            f64_ops=len(F64_OP.findall(ptx)),
            approx_divs=len(APPROX_DIV.findall(ptx)), approx_logs=len(APPROX_LOG.findall(ptx)),
            sass_per_logit=per_logit, loop_barriers=barriers,
            **{k: v for k, v in constexprs.items() if k.startswith("BLOCK")})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
