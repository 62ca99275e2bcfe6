"""Peak resident memory beyond the inputs of one CPU torch case, in its own process.

``python -m bench.memory OBJECTIVE VARIANT N K DTYPE`` prints the VmHWM growth in bytes of
one forward+backward after the inputs exist (VmHWM reset through /proc/self/clear_refs;
tracemalloc does not see torch's allocations). One process per case, so one case's peak
cannot pollute another's.
"""

import gc
import os
import subprocess
import sys



def proc_status_bytes(field):
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in bytes (Linux only)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def reset_peak_rss():
    """Reset VmHWM to the current RSS (writes 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def available():
    return os.path.exists("/proc/self/clear_refs")


def package_cwd():
    """Where a subprocess can run ``python -m <this package>.<module>``: the repository root
    for ``bench`` (``python -m bench`` from a checkout), anywhere (None: the caller's) for the
    installed ``dlm_kernels.bench``."""
    if __package__ == "bench":
        return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return None


def probe_in_subprocess(args):
    """Run ``python -m <args>`` (a module's memory probe) in a fresh interpreter (from
    ``package_cwd``) and return the byte count it prints last; None where /proc cannot be
    reset."""
    if not available():
        return None
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                         check=True, cwd=package_cwd())
    return int(out.stdout.strip().splitlines()[-1])


def rss_peak_delta(run, warm):
    """VmHWM growth over the current RSS during ``run()``, after ``warm()`` ran the same code
    paths at a small size (so their one-off allocations fall outside the window)."""
    warm()
    gc.collect()
    base = proc_status_bytes("VmRSS")
    reset_peak_rss()
    out = run()
    peak = proc_status_bytes("VmHWM") - base
    del out
    return peak


def cuda_peak_delta(run):
    """The CUDA allocator's peak growth during ``run()``."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def cpu_peak_bytes(objective, variant, n, k, dtype):
    """The probe below, in a fresh interpreter; None where /proc cannot be reset."""
    return probe_in_subprocess([f"{__package__}.memory", objective, variant, str(n), str(k), dtype])


def main():
    from .cases import TorchCase

    objective, variant, n, k, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    case = TorchCase(objective, variant, n, k, dtype, "cpu")
    print(rss_peak_delta(lambda: case.fwdbwd(0),
                         lambda: TorchCase(objective, variant, 4, k, dtype, "cpu").fwdbwd(0)))


if __name__ == "__main__":
    main()
