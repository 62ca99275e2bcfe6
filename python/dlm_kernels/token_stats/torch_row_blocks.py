"""The chunked backend's CPU schedule: row blocks on single-threaded workers.

An eager chunk loop runs a few ATen ops per [N, C] chunk, each one OpenMP parallel region
over the intra-op threads. On a shared CPU every region waits for its slowest thread, and a
thread the scheduler has parked stalls them all: bench/NOTES.md ("The torch chunked path on
a CPU") measured the same backward 5x slower at 2 intra-op threads than at 1 under load.
Here the rows are cut into blocks (``row_blocks``); up to ``torch.get_num_threads()``
persistent workers, each with one intra-op thread (no parallel region, no barrier), take
blocks from one queue, so a worker that loses its core takes fewer blocks instead of
stalling the others. A block's [R, C] tiles stay in the core's cache (``TILE_BYTES``).

Each block runs a few ATen calls per tile from Python, and two workers' calls contend for
the interpreter lock, so a block must hold enough logits to outweigh that
(``BLOCK_ELEMENTS``), and a second worker only pays from ``WORKER_ELEMENTS`` logits per
worker on: below that one thread is faster (bench/NOTES.md, "Row blocks sized by the work").

Only for CPU tensors outside tracing (``use_row_blocks``): accelerators and torch.compile
keep the plain chunk loop. Blocks are independent rows, so results do not depend on which
worker ran a block.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

ROW_BLOCK = 64  # rows of a block: at least this, and a multiple of it
BLOCK_ELEMENTS = 1 << 20  # logits a block holds at least (rows x K), where N allows
WORKER_ELEMENTS = 1 << 22  # logits of the call per worker: fewer, fewer workers
TILE_BYTES = 1024 * 1024  # one [R, C] float32 tile of a block

class _Scratch(threading.local):
    """Each thread's float32 tile buffer (``scratch``); empty until the thread's first call."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.float32)


_SCRATCH = _Scratch()
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()
# a forked child (a DataLoader worker) has none of the parent's threads: it starts its own
os.register_at_fork(after_in_child=_POOLS.clear)


def use_row_blocks(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def scratch(*shape: int) -> torch.Tensor:
    """An uninitialised float32 tensor of ``shape`` in the calling thread's own buffer,
    which its next call reuses (grown when a call needs more). A fresh tile per block is a
    fresh mapping whose pages fault in, and two workers faulting at once wait on each other
    for the process's page tables. The buffer stays with the thread: at most the few tiles
    of one block (8 MiB with a teacher), per worker and per calling thread."""
    numel = math.prod(shape)
    buf = _SCRATCH.buf
    if buf.numel() < numel:
        buf = _SCRATCH.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel].view(shape)


def _one_thread(barrier: threading.Barrier) -> None:
    """Set this worker to one intra-op thread, for good. ATen initialises a thread's OpenMP
    team size lazily, at its first parallel op, from the process-wide setting, which the
    caller puts back to its own count once the workers start; so the first op runs here,
    at one thread. (Left to later, each worker ran two-thread teams: four threads on two
    cores, and libgomp, managing more threads than CPUs, then spun less before sleeping,
    which made every later parallel op of the process about 2x slower.)"""
    torch.set_num_threads(1)
    torch.ones(1 << 16).exp_()  # past ATen's grain size: the lazy initialisation, now
    barrier.wait()


def _pool(workers: int) -> ThreadPoolExecutor:
    """A persistent pool of ``workers`` threads, each set to one intra-op thread. Setting
    it also resets torch's process-wide default for new threads, which is put back."""
    with _POOL_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            caller = torch.get_num_threads()
            pool = ThreadPoolExecutor(workers, thread_name_prefix="dlm-rows")
            barrier = threading.Barrier(workers + 1)
            for _ in range(workers):  # each waits at the barrier: all threads start
                pool.submit(_one_thread, barrier)
            barrier.wait()
            torch.set_num_threads(caller)
            _POOLS[workers] = pool
        return pool


def row_blocks(n: int, k: int) -> list[tuple[int, int]]:
    """[(r0, r1)] blocks of the [N, K] logits' rows: ROW_BLOCK rows, or the multiple of it
    that holds BLOCK_ELEMENTS logits."""
    rows = ROW_BLOCK * max(1, BLOCK_ELEMENTS // (ROW_BLOCK * max(k, 1)))
    return [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]


def _no_grad(fn, r0: int, r1: int):
    with torch.no_grad():  # grad mode is per thread: the caller's no_grad does not reach here
        return fn(r0, r1)


def run_blocks(fn, n: int, k: int) -> list:
    """[fn(r0, r1) for each row block of the [N, K] logits] under no_grad, the blocks shared
    out over the workers (one per WORKER_ELEMENTS logits, up to the intra-op threads)."""
    blocks = row_blocks(n, k)
    workers = min(torch.get_num_threads(), len(blocks), max(1, n * k // WORKER_ELEMENTS))
    if workers <= 1:
        return [_no_grad(fn, r0, r1) for r0, r1 in blocks]
    pool = _pool(workers)
    return [f.result() for f in [pool.submit(_no_grad, fn, r0, r1) for r0, r1 in blocks]]
