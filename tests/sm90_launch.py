"""What the sm_90 compile probes share (``aot_probe.py``, ``specialisation_probe.py``): the
ptxas check, the token-statistics kernels' argument types and launch integers as a launch
at K = 262144 has them, and the kernels with their compile-time flags. Not a test file:
the probes run as subprocesses of the tests and import it from this folder."""

import sys

from dlm_kernels.kernels.triton import token_stats as K

VOCAB = 262144  # the launch the probes compile for: DiffusionGemma's vocabulary


def ptxas_or_exit() -> str:
    """The path of the ptxas Triton uses for sm_90; exit 3 (the tests skip) without one."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except Exception as err:  # noqa: BLE001
        print(f"no ptxas for sm_90 in this triton: {err}")
        sys.exit(3)


def stats_arg_types(ptr: str) -> dict:
    """Every token-statistics kernel argument's Triton type, [N, K] arrays of ``ptr`` (e.g.
    "*bf16"). An integer under 2^31 is typed i32 at launch, row strides included (the
    kernels widen row offsets themselves)."""
    return {"z_ptr": ptr, "u_ptr": ptr, "dz_ptr": ptr, "du_ptr": ptr, "x_ptr": "*i64",
            "y_ptr": "*i64", "d_ptr": "*fp32", "active_ptr": "*i8", "part_ptr": "*fp32",
            "out_ptr": "*fp32", "stats_ptr": "*fp32", "g_lse_ptr": "*fp32",
            "g_lp_ptr": "*fp32", "g_h_ptr": "*fp32", "g_kl_ptr": "*fp32", "N": "i32",
            "K": "i32", "S": "i32", "stride_z": "i32", "stride_u": "i32", "stride_dz": "i32",
            "stride_du": "i32", "cols_per_split": "i32", "col_offset_ptr": "*i32",
            "vocab_limit": "i32", "inv_t": "fp32", "inv_t_ce": "fp32", "inv_t_kl": "fp32",
            "softcap": "fp32"}


def stats_launch_ints(plan: dict, n: int) -> dict:
    """The integer arguments of a launch over N rows of K = VOCAB columns (contiguous rows,
    no vocabulary padding) under ``plan`` (``launch_config``)."""
    k = VOCAB
    return dict(N=n, K=k, S=plan["splits"], stride_z=k, stride_u=k, stride_dz=k, stride_du=k,
                cols_per_split=plan["cols_per_split"], vocab_limit=2**31 - 1)


def streaming_kernels(plan: dict, flags: dict, teacher_grad: bool, ce: bool = True) -> list:
    """[(kernel, constexprs, num_warps)] of the partial and gradient kernels; ``ce``: label
    smoothing's Σ r (SMOOTH) and the CE term's per-row coefficients (CE_TERMS) on."""
    return [(K.stats_partial_kernel, dict(flags, BLOCK_K=plan["block_k"], VEC=plan["vec"],
                                          ROWS_ALIGNED=True, SMOOTH=ce), plan["num_warps"]),
            (K.stats_grad_kernel, dict(flags, TEACHER_GRAD=teacher_grad,
                                       BLOCK_K=plan["block_k"], ROWS_ALIGNED=True,
                                       CE_TERMS=ce), plan["num_warps"])]


def finalize_kernel(flags: dict, smooth: bool = True) -> tuple:
    """(kernel, constexprs, num_warps) of the finalize kernel."""
    return (K.stats_finalize_kernel, dict(flags, BLOCK_N=K.FINALIZE_ROWS, SMOOTH=smooth),
            K.FINALIZE_WARPS)
