"""transformers' DiffusionGemma, dense vs patched: peak memory and time of the head's work.

    python -m bench.diffusion_gemma                  # this device's default shapes
    python -m bench.diffusion_gemma --d 256,512 --v 262144 --canvas 256 --dtype bfloat16

A random ``DiffusionGemmaForBlockDiffusion`` (no download) at the released head's shape
(vocabulary V 262144, canvas L 256, batch B 1, final_logit_softcapping 30, tied table) with a
reduced hidden size D and 1 tiny decoder layer: only the head matters to the peak, and its
terms either do not depend on D (the [B, L, V] buffers) or grow linearly with it (the table
and its gradient). Two cases, each dense and patched:

  loss  one training forward+backward of the loss of NeMo Automodel's DiffusionGemma
        recipe: the token-mean cross-entropy of the capped logits over all B·L canvas
        positions plus the prompt's next-token cross-entropy (the encoder's hidden states
        through the same head):
          dense    the unpatched model's capped float32 [B, L, V] logits (and the prompt's,
                   capped alike), then ``F.cross_entropy`` on each
          patched  ``apply_dlm_kernels_to_diffusion_gemma(model)``, ``model(...,
                   labels=x0, encoder_labels=prompt)`` (the fused capped-head loss, logits
                   never formed)
  step  one denoising step inside ``model.generate`` (its second step: the previous step's
        self-conditioning logits are an input, as in every step after the first):
          dense    transformers' step (softmax, multinomial, argmax, Categorical entropies)
          patched  the fused step with fused self-conditioning (no adaptive stopping, the
                   temperature schedule as the only logits processor): the decoder's hidden
                   states through the capped tied head (``sample_tokens`` + ``commit_tokens``)
                   and the next step's [B, L, D] signal (``soft_embedding``); no [B, L, V]
                   buffer

Peak memory: resident-set growth over one call in a fresh process (the allocator's mapping
threshold fixed as in ``bench/memory.py``), after a warm-up call at the same shape; the
weights and inputs exist before the window, so it is the peak beyond them. For the loss the
parameter gradients are allocated inside the window (``zero_grad(set_to_none=True)`` before
it) and are part of the peak; their size is reported beside it. Times: median of the timed
calls (p20-p80) in this process.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import subprocess
import sys
import time

from .cli import add_common_args, detect, write_outputs
from .memory import (PROBE_ENV, available, cuda_peak_delta, package_cwd, proc_status_bytes,
                     reset_peak_rss, rss_peak_delta)
from .timing import measure

CASES = ("loss-dense", "loss-patched", "step-dense", "step-patched")
CAP = 30.0
PROMPT = 8  # prompt tokens (the encoder's input); the peaks are the canvas's
#: the released head's shape at a reduced hidden size (CPU); bench/gpu_check.sh runs the
#: full-size D values of the candidates on a GPU
CPU_SHAPE = dict(ds=(256, 512), v=262144, canvas=256, batch=1, dtype="bfloat16")
#: hidden sizes on a GPU: 2304, the hidden size of transformers' DiffusionGemmaConfig
#: defaults (transformers 5.23.0, documented against google/diffusiongemma-26B-A4B-it), first;
#: 2112 and 2816, named by other sources, beside it
GPU_DS = (2304, 2112, 2816)
TARGET_RATIO = 4.0  # the patched peak at least 4x below the dense one


def tiny_config(d: int, v: int, canvas: int):
    """One decoder layer of width ``d`` (full attention, 2 experts of 1 active), vocabulary
    ``v``, canvas ``canvas``; the cap 30 (the config's default)."""
    from transformers import DiffusionGemmaConfig

    text = dict(vocab_size=v, hidden_size=d, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=32,
                num_experts=2, top_k_experts=1, moe_intermediate_size=32, sliding_window=8,
                layer_types=["full_attention"], max_position_embeddings=2 * canvas + 64)
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=16)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas,
                                  boi_token_id=v - 3, eoi_token_id=v - 2, image_token_id=v - 1)
    config._experts_implementation = "eager"
    config.text_config._experts_implementation = "eager"
    return config


class Case:
    """One case at one shape: ``call(i)`` runs it once (a fresh input draw per i)."""

    def __init__(self, case: str, d: int, v: int, canvas: int, batch: int, dtype: str,
                 device: str = "cpu", seed: int = 0):
        import torch
        from transformers import DiffusionGemmaForBlockDiffusion

        from dlm_kernels.torch.integrations import apply_dlm_kernels_to_diffusion_gemma

        if case not in CASES:
            raise ValueError(f"case must be one of {CASES}; got {case!r}")
        self.torch, self.case, self.device = torch, case, torch.device(device)
        self.v, self.canvas, self.batch = v, canvas, batch
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(tiny_config(d, v, canvas))
        model = model.to(device=self.device, dtype=getattr(torch, dtype))
        if model.final_logit_softcapping != CAP:
            raise RuntimeError(f"expected the cap {CAP}; got {model.final_logit_softcapping}")
        if case.endswith("patched"):  # this instance only; the step carries soft embeddings
            apply_dlm_kernels_to_diffusion_gemma(
                model, fused_self_conditioning=case.startswith("step"))
        self.model = model.train() if case.startswith("loss") else model.eval()
        self.step_peaks, self.step_times = [], []
        if case.startswith("step"):
            self._wrap_step()

    def _inputs(self, i: int):
        g = self.torch.Generator().manual_seed(1000 + i)
        prompt = self.torch.randint(0, self.v - 3, (self.batch, PROMPT), generator=g)
        canvas = self.torch.randint(0, self.v, (self.batch, self.canvas), generator=g)
        x0 = self.torch.randint(0, self.v, (self.batch, self.canvas), generator=g)
        return prompt.to(self.device), canvas.to(self.device), x0.to(self.device)

    def loss(self, i: int):
        """One forward+backward of the recipe's loss (the canvas's token-mean CE plus the
        prompt's next-token CE); the parameter gradients are new."""
        torch, model = self.torch, self.model
        model.zero_grad(set_to_none=True)
        prompt, canvas, x0 = self._inputs(i)
        if self.case == "loss-patched":
            loss = model(input_ids=prompt, decoder_input_ids=canvas, labels=x0,
                         encoder_labels=prompt).loss
        else:
            out = model(input_ids=prompt, decoder_input_ids=canvas)
            ce = torch.nn.functional.cross_entropy
            z = model.lm_head(out.encoder_last_hidden_state[:, :-1]).float()
            z = torch.tanh(z / CAP) * CAP  # the encoder's capped logits, as the canvas's
            loss = (ce(out.logits.view(-1, self.v), x0.view(-1))
                    + ce(z.reshape(-1, self.v), prompt[:, 1:].reshape(-1)))
            del out, z
        loss.backward()
        return loss.detach()

    def _wrap_step(self):
        """Measure every denoising step after the first (its input self-conditioning logits
        exist then): its resident-set peak (``measure_steps``) and its time."""
        inner = self.model._denoising_step
        self.measure_steps = False

        def step(**kwargs):
            if kwargs.get("self_conditioning_logits") is None:  # the first step
                return inner(**kwargs)
            if self.measure_steps:
                gc.collect()
                base = proc_status_bytes("VmRSS")
                reset_peak_rss()
            t0 = time.perf_counter()
            out = inner(**kwargs)
            if self.device.type == "cuda":
                self.torch.cuda.synchronize()
            self.step_times.append(time.perf_counter() - t0)
            if self.measure_steps:
                self.step_peaks.append(proc_status_bytes("VmHWM") - base)
            return out

        self.model._denoising_step = step

    def step(self, i: int, steps: int = 2):
        """``generate`` of one canvas with ``steps`` denoising steps (adaptive stopping off;
        the decoder eager in both cases: fused self-conditioning runs with the eager decoder,
        and where transformers would compile it for a static cache, dense and patched then
        run the same decoder code)."""
        prompt = self._inputs(i)[0]
        self.torch.manual_seed(i)
        with self.torch.no_grad():
            return self.model.generate(prompt, max_new_tokens=self.canvas,
                                       max_denoising_steps=steps, stability_threshold=None,
                                       confidence_threshold=None, disable_compile=True)

    def call(self, i: int):
        return self.loss(i) if self.case.startswith("loss") else self.step(i)

    def grad_bytes(self) -> int:
        """Bytes of the parameter gradients the last call left (0 after a step)."""
        return sum(p.grad.numel() * p.grad.element_size() for p in self.model.parameters()
                   if p.grad is not None)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def _times(c: Case, reps: int) -> dict:
    """Median (p20-p80) ms of ``reps`` calls of a warm case: the loss's forward+backward, or
    the denoising steps after the first inside one ``generate``."""
    if c.case.startswith("loss"):
        t = measure(c.call, cuda=c.device.type == "cuda", warmup=0, reps=reps, budget_s=1e9)
        return dict(ms=t["ms"], p20=t["p20"], p80=t["p80"], reps=t["reps"])
    c.step_times.clear()
    c.step(2, steps=reps + 1)
    times = sorted(1e3 * s for s in c.step_times)
    c.step_times.clear()
    return dict(ms=times[len(times) // 2], p20=times[int(0.2 * (len(times) - 1))],
                p80=times[int(round(0.8 * (len(times) - 1)))], reps=len(times))


def _probe(case: str, d: int, v: int, canvas: int, batch: int, dtype: str,
           reps: int = 0) -> dict:
    """The peak of one call beyond what exists before it (a warm-up call first), then the
    times of ``reps`` more calls (none for 0)."""
    c = Case(case, d, v, canvas, batch, dtype)
    if case.startswith("loss"):
        def warm():  # the warm-up's gradients freed before the window, not inside it
            c.call(0)
            c.model.zero_grad(set_to_none=True)
        peak = rss_peak_delta(lambda: c.call(1), warm)
    else:
        c.call(0)  # warm-up: both steps' code paths at this shape
        c.measure_steps = True
        c.step(1, steps=2)
        c.measure_steps = False
        (peak,) = c.step_peaks
    out = dict(peak_bytes=int(peak), grad_bytes=c.grad_bytes(), weight_bytes=c.weight_bytes())
    print(json.dumps(out), flush=True)  # the peak, before the (long) timed calls
    if reps:
        out.update(_times(c, reps))
    return out


def cpu_peak(case: str, d: int, v: int, canvas: int, batch: int, dtype: str,
             reps: int = 0) -> dict | None:
    """``_probe`` in a fresh interpreter; None where /proc cannot be reset."""
    if not available():
        return None
    out = subprocess.run(
        [sys.executable, "-m", f"{__package__}.diffusion_gemma", "--probe", case, "--d", str(d),
         "--v", str(v), "--canvas", str(canvas), "--batch", str(batch), "--dtype", dtype,
         "--reps", str(reps)],
        capture_output=True, text=True, check=True, cwd=package_cwd(),
        env={**os.environ, **PROBE_ENV})
    return json.loads(out.stdout.strip().splitlines()[-1])


def cuda_peak(c: Case) -> dict:
    torch = c.torch
    if c.case.startswith("loss"):
        c.call(0)
        c.model.zero_grad(set_to_none=True)
        peak = cuda_peak_delta(lambda: c.call(1))
    else:
        c.call(0)
        peaks = []
        inner = c.model._denoising_step

        def step(**kwargs):
            if kwargs.get("self_conditioning_logits") is None:
                return inner(**kwargs)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = inner(**kwargs)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - before)
            return out

        c.model._denoising_step = step
        c.step(1, steps=2)
        c.model._denoising_step = inner
        (peak,) = peaks
    return dict(peak_bytes=int(peak), grad_bytes=c.grad_bytes(), weight_bytes=c.weight_bytes())


def blv_bytes(batch: int, canvas: int, v: int) -> int:
    """One float32 [B, L, V] buffer."""
    return batch * canvas * v * 4


def run(ds, v, canvas, batch, dtype, reps=3, cases=CASES, cuda=False, memory=True, jobs=1,
        progress=print) -> dict:
    """Every case at every D: the peak (``memory``) and the times of ``reps`` calls. On a
    CPU with ``memory`` each case runs in a fresh process of its own (``jobs`` of them at a
    time: their peaks are per process, their times then share the cores); else in this one."""
    import torch

    device = "cuda" if cuda else "cpu"
    todo = [dict(case=case, d=d, v=v, canvas=canvas, batch=batch, dtype=dtype)
            for d in ds for case in cases]

    def one(row):
        row = dict(row)
        try:
            if memory and not cuda:
                row.update(cpu_peak(row["case"], row["d"], v, canvas, batch, dtype, reps)
                           or dict(peak_bytes=None))
                row["peak_kind"] = "resident-set growth, fresh process"
                if "ms" not in row:  # no /proc: timed here
                    c = Case(row["case"], row["d"], v, canvas, batch, dtype, device)
                    c.call(0)
                    row.update(_times(c, reps))
            else:
                c = Case(row["case"], row["d"], v, canvas, batch, dtype, device)
                if memory:
                    row.update(cuda_peak(c), peak_kind="cuda allocator peak")
                else:
                    row.update(peak_bytes=None, peak_kind="not measured")
                    c.call(0)
                row.update(_times(c, reps))
                del c
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
        except Exception as err:  # noqa: BLE001 - e.g. out of memory
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        progress(_line(row))
        return row

    if memory and not cuda and jobs > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(one, todo))
    else:
        results = [one(row) for row in todo]
    env = detect()
    return dict(device=env["device"], date=_dt.date.today().isoformat(), versions=env["versions"],
                load_after=os.getloadavg() if hasattr(os, "getloadavg") else None,
                jobs=jobs if memory and not cuda else 1,
                blv_float32_bytes=blv_bytes(batch, canvas, v), results=results,
                fits=fit(results, batch, canvas, v))


def _line(r):
    what = f"diffusion_gemma: {r['case']:13s} D={r['d']} V={r['v']} L={r['canvas']} {r['dtype']}"
    if "error" in r:
        return f"{what} {r['error']}"
    peak = "n/a" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:8.1f} MiB"
    return f"{what} {r['ms']:9.1f} ms  peak {peak}"


def fit(results, batch, canvas, v):
    """Per case, peak(D) = a + b·D through the measured D values (two or more: least
    squares), a in units of float32 [B, L, V] buffers and b in bytes per unit of D per
    vocabulary row (b / V: 2 is one bfloat16 [V, D] table, 4 one float32); and per pair the
    ratio dense / patched at each measured D."""
    import numpy as np

    out = {}
    for case in CASES:
        rows = [r for r in results if r["case"] == case and r.get("peak_bytes") is not None]
        if len({r["d"] for r in rows}) < 2:
            continue
        d = np.array([r["d"] for r in rows], float)
        p = np.array([r["peak_bytes"] for r in rows], float)
        b, a = np.polyfit(d, p, 1)
        out[case] = dict(a_bytes=float(a), b_bytes_per_d=float(b),
                         a_in_blv_float32=float(a / blv_bytes(batch, canvas, v)),
                         b_over_v=float(b / v))
    return out


def ratios(results):
    """{(kind, d): dense peak / patched peak} for each D with both measured."""
    peaks = {(r["case"], r["d"]): r.get("peak_bytes") for r in results}
    out = {}
    for (case, d), p in peaks.items():
        kind, variant = case.split("-")
        other = peaks.get((f"{kind}-patched", d))
        if variant == "dense" and p and other:
            out[(kind, d)] = p / other
    return out


def markdown(report):
    res = report["results"]
    blv = report["blv_float32_bytes"]
    load = report.get("load_after")
    lines = [f"### DiffusionGemma head: dense vs patched (device: {report['device']}; "
             f"{report['date']})", "",
             f"One float32 [B, L, V] buffer: {blv / 2**20:.0f} MiB. Peak: beyond the weights "
             "and inputs (loss: the parameter gradients are allocated inside the measured "
             "call, so they count wherever they are alive at its peak; their size beside it)."
             + (f" Load average after the run: {load[0]:.2f} (1 min)." if load else ""), "",
             "| case | D | V | L | dtype | peak MiB | of which param. grads MiB | peak / [B,L,V] f32 "
             "| ms median (p20-p80) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        head = f"| {r['case']} | {r['d']} | {r['v']} | {r['canvas']} | {r['dtype']} |"
        if "error" in r:
            lines.append(f"{head} {r['error'][:100]} | | | |")
            continue
        pk = r.get("peak_bytes")
        peak = "n/a" if pk is None else f"{pk / 2**20:.0f}"
        units = "n/a" if pk is None else f"{pk / blv:.2f}"
        lines.append(f"{head} {peak} | {r.get('grad_bytes', 0) / 2**20:.0f} | {units} | "
                     f"{r['ms']:.0f} ({r['p20']:.0f}-{r['p80']:.0f}) |")
    rat = ratios(res)
    if rat:
        lines += ["", "| D | loss: dense / patched peak | step: dense / patched peak |",
                  "|---|---|---|"]
        for d in sorted({d for _, d in rat}):
            cell = lambda k: f"{rat[(k, d)]:.2f}x" if (k, d) in rat else "n/a"
            lines.append(f"| {d} | {cell('loss')} | {cell('step')} |")
    if report["fits"]:
        lines += ["", "Linear fit peak(D) = a + b·D through the measured D values "
                  "(a in float32 [B, L, V] buffers, b / V in bytes per table element):", "",
                  "| case | a (MiB) | a / [B,L,V] f32 | b / V (bytes) |", "|---|---|---|---|"]
        for case, f in report["fits"].items():
            lines.append(f"| {case} | {f['a_bytes'] / 2**20:.0f} | {f['a_in_blv_float32']:.2f} | "
                         f"{f['b_over_v']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.diffusion_gemma", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", default=None,
                   help="hidden sizes, comma-separated (default: 256,512 on a CPU; "
                        f"{','.join(map(str, GPU_DS))} on a GPU)")
    p.add_argument("--v", type=int, default=CPU_SHAPE["v"], help="vocabulary (default 262144)")
    p.add_argument("--canvas", type=int, default=CPU_SHAPE["canvas"],
                   help="canvas length L (default 256)")
    p.add_argument("--batch", type=int, default=CPU_SHAPE["batch"], help="batch B (default 1)")
    p.add_argument("--dtype", default=CPU_SHAPE["dtype"], help="weights' dtype (default bfloat16)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    p.add_argument("--jobs", type=int, default=1,
                   help="CPU: cases run in this many fresh processes at a time (default 1)")
    add_common_args(p)
    p.set_defaults(reps=3)
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    ds = ([int(x) for x in args.d.split(",")] if args.d
          else list(GPU_DS if cuda else CPU_SHAPE["ds"]))
    if args.probe:
        print(json.dumps(_probe(args.probe, ds[0], args.v, args.canvas, args.batch, args.dtype,
                                args.reps)))
        return None
    report = run(ds, args.v, args.canvas, args.batch, args.dtype, reps=args.reps,
                 cases=args.cases.split(","), cuda=cuda, jobs=args.jobs)
    write_outputs(args, report, markdown(report))
    return report


if __name__ == "__main__":
    main()
