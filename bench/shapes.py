"""The one table of benchmark shapes, shared by the runner and the microbenchmarks.

Rows N = B·L canvas positions; K the vocabulary of a real diffusion LM.
"""

MODELS = {
    "gemma": 262144,  # DiffusionGemma
    "llada": 126464,  # LLaDA
    "dream": 151936,  # Dream
    "32k": 32768,  # a 32k vocabulary
}

# (label, N, K, dtype). The GPU grid of the Triton issue, the target shape first.
GPU_SHAPES = [(f"N{n}-K{k}", n, k, "bfloat16")
              for n in (16384, 4096) for k in (262144, 131072, 32768)]
MODEL_SHAPES = [(f"{m}-N4096", 4096, k, "bfloat16") for m, k in MODELS.items()]
# --full: the grid, then the model vocabularies it lacks (gemma and 32k at N 4096 are in it)
FULL_SHAPES = GPU_SHAPES + [s for s in MODEL_SHAPES
                            if (s[1], s[2]) not in {(n, k) for _, n, k, _ in GPU_SHAPES}]
CPU_SHAPES = [
    ("cpu-N512-K4k", 512, 4096, "float32"),
    ("cpu-N512-K32k", 512, 32768, "float32"),
    ("cpu-N512-K32k-bf16", 512, 32768, "bfloat16"),  # 16-bit logits, float32 math
]
# the quick main job on a CPU (python -m bench without --full): minutes on 2 cores; three
# vocabularies per dtype, so that each line of the plot shows a trend
QUICK_CPU_SHAPES = [(f"cpu-N256-K{k // 1024}k" + ("-bf16" if dtype == "bfloat16" else ""),
                     256, k, dtype)
                    for dtype in ("float32", "bfloat16") for k in (2048, 4096, 16384)]
SMOKE_SHAPES = [("smoke-N64-K1271", 64, 1271, "float32")]
# --cpu-target: the CPU target grid, the smaller vocabulary first (a run cut short
# keeps it): what torch chunked must be at least as fast as torch.compile on
CPU_TARGET_SHAPES = [(f"cpu-N4096-K{k // 1024}k" + ("-bf16" if dtype == "bfloat16" else ""),
                      4096, k, dtype)
                     for k in (32768, 131072) for dtype in ("float32", "bfloat16")]
CPU_TARGET_OBJECTIVES = ("ce", "sft", "policy", "opd")
CPU_TARGET_VARIANTS = {"torch": ("chunked", "upstream", "upstream+compile"),
                       "jax": ("chunked", "upstream")}
#: more variants of ours at the CPU target, by (framework, objective): the policy loss with
#: its gradient written over the logits (``inplace_grad=True``), the memory target's option
CPU_TARGET_EXTRA = {("torch", "policy"): ("chunked+inplace",)}


def cpu_target_variants(framework, objective):
    """The variants timed at the CPU target for one framework and objective."""
    return (CPU_TARGET_VARIANTS[framework][:1] + CPU_TARGET_EXTRA.get((framework, objective), ())
            + CPU_TARGET_VARIANTS[framework][1:])
# with --busy-core, these cases once more beside a busy loop (the label gains "-busy")
CPU_TARGET_BUSY = dict(shape=CPU_TARGET_SHAPES[0], objective="ce", framework="torch")

OBJECTIVES = ("ce", "sft", "policy", "opd")
MODES = ("fwd", "bwd", "fwd+bwd")


def bytes_moved(objective, mode, n, k, elem_bytes):
    """Bytes the pass structure must move (docs/design.md §7): forward reads the logits once,
    backward reads them and writes the gradient; OPD streams the teacher beside them (sft
    moves what ce moves: its shift and weights are [N] values)."""
    row = n * k * elem_bytes
    teacher = row if objective == "opd" else 0
    fwd = row + teacher
    bwd = 2 * row + teacher
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]
