"""Peak resident memory beyond the inputs of one CPU torch case, in its own process (with a
fixed allocator mapping threshold, ``PROBE_ENV``, so the peak is that of live buffers).

``python -m bench.memory OBJECTIVE VARIANT N K DTYPE`` prints the VmHWM growth in bytes of
one forward+backward after the inputs exist (VmHWM reset through /proc/self/clear_refs;
tracemalloc does not see torch's allocations). One process per case, so one case's peak
cannot pollute another's. ``cpu_peak_bytes`` gets the same number from a process forked
for the case off one server that imported torch once (``--serve``): the fork starts from
the state a fresh interpreter has after its imports, without paying them per case.
"""

import atexit
import gc
import os
import subprocess
import sys

from . import cases


# glibc's allocator, left to itself, keeps freed buffers of up to 32 MiB mapped and moves its
# mapping threshold with what was freed before, so a resident-set peak counts cached memory
# and changes from run to run (the same linear-head step: 64 or 151 MiB). With a fixed
# threshold of 128 KiB every larger buffer is mapped when allocated and unmapped when freed:
# the peak is that of the live buffers, the same in every run. Probe processes only (the
# timed runs keep the allocator's defaults).
PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def _probe_env():
    return {**os.environ, **PROBE_ENV}


def proc_status_bytes(field):
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in bytes (Linux only)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def meminfo_bytes(field):
    """A field of /proc/meminfo (MemAvailable, MemTotal, ...) in bytes; None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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
                         check=True, cwd=package_cwd(), env=_probe_env())
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


class _ProbeServer:
    """One ``--serve`` subprocess for the run, asked one case per line."""

    process = None

    @classmethod
    def ask(cls, line):
        if cls.process is None or cls.process.poll() is not None:
            cls.process = subprocess.Popen(
                [sys.executable, "-m", f"{__package__}.memory", "--serve"], cwd=package_cwd(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_probe_env())
            atexit.register(cls.close)
        cls.process.stdin.write(line + "\n")
        cls.process.stdin.flush()
        answer = cls.process.stdout.readline().strip()
        if not answer.lstrip("-").isdigit():
            raise RuntimeError(f"memory probe of {line!r} failed: {answer or 'no answer'}")
        return int(answer)

    @classmethod
    def close(cls):
        if cls.process is not None and cls.process.poll() is None:
            cls.process.stdin.close()
            cls.process.wait(timeout=30)
        cls.process = None


def cpu_peak_bytes(objective, variant, n, k, dtype):
    """The probe below, in a process of its own; None where /proc cannot be reset."""
    if not available():
        return None
    return _ProbeServer.ask(" ".join((objective, variant, str(n), str(k), dtype)))


def _probe(objective, variant, n, k, dtype):
    # one input set: the peak beyond the inputs is that of one call whatever the timed case
    # rotates through, and a second set could push a large case out of memory
    case = cases.TorchCase(objective, variant, int(n), int(k), dtype, "cpu", rotate=1)
    # The warm-up is the same call, at the same shape: every compile it triggers (a
    # torch.compile peer's static graph, our compiled CPU loops) and Inductor's imports fall
    # outside the window. A warm-up at another shape made a static-shape peer compile again
    # inside it, and that compile's ~33 MiB, not the loss's, was the peak reported for
    # torch.compile at the quick grid's shapes (2-16 MiB of gradient).
    return rss_peak_delta(lambda: case.fwdbwd(0), lambda: case.fwdbwd(0))


def _serve():
    """Answer each line of stdin (a case) with its probe, measured in a child forked for it."""
    import torch  # noqa: F401  (the imports every case needs, once)

    import dlm_kernels.torch  # noqa: F401

    for line in sys.stdin:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: measure, answer through the pipe, exit at once
            os.close(read)
            try:
                answer = str(_probe(*line.split()))
            except Exception as err:  # noqa: BLE001 - reported to the asking side
                answer = f"{type(err).__name__}: {err}".replace("\n", " ")[:300]
            os.write(write, (answer + "\n").encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            answer = f.read().strip()
        os.waitpid(pid, 0)
        print(answer, flush=True)


def main():
    if sys.argv[1:] == ["--serve"]:
        return _serve()
    print(_probe(*sys.argv[1:6]))


if __name__ == "__main__":
    main()
