"""Command-line pieces shared by the benchmark modules that run on their own
(``bench.linear_head``, ``bench.sampling``) and the main job (``bench.runner``): their
arguments, their outputs, and the machine a report describes (``detect``)."""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import sys

import numpy as np


def add_common_args(parser):
    """--reps, --json, --md, and the hidden --probe of the memory-probe subprocess."""
    parser.add_argument("--reps", type=int, default=5, help="timed calls per case (default 5)")
    parser.add_argument("--json", default=None, help="also write the report to this file")
    parser.add_argument("--md", default=None, help="also write the Markdown table to this file")
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)


def write_outputs(args, report, table):
    """Print the table; write the report and the table where --json / --md ask."""
    print(table)
    for path, text in ((args.json, json.dumps(report, indent=1)), (args.md, table)):
        if path:
            with open(path, "w") as f:
                f.write(text)


def device_slug(device):
    """A results file's device part: the device's words in lower case, joined by hyphens
    (at most 48 characters)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()[:48]


def try_import(name):
    """The module ``name``, or None where it does not import."""
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001
        return None


def detect():
    """The machine and versions a report describes (device, CUDA, frameworks, date, argv)."""
    torch, jax = try_import("torch"), try_import("jax")
    cuda = bool(torch is not None and torch.cuda.is_available())
    if torch is not None and cuda:
        device = torch.cuda.get_device_name()
    else:
        model = platform.processor() or "cpu"
        try:
            with open("/proc/cpuinfo") as f:
                model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
        device = f"{model} ({os.cpu_count()} cores)"
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    # Read from the installed metadata, not by importing: importing jax_triton blanks
    # TRITON_CACHE_DIR for the whole process (dlm_kernels.jax undoes that when it loads it), and
    # every later Triton compile in this process, torch's kernels too, would then fail.
    for name in ("torch", "jax", "jaxlib", "triton", "liger_kernel", "jax_triton"):
        try:
            versions[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            pass
    return dict(device=device, cuda=cuda, torch=torch is not None, jax=jax is not None,
                jax_backend=jax.default_backend() if jax is not None else None,
                versions=versions, date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                argv=sys.argv[1:])
