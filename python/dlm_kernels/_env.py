"""What the environment decides: the environment variables the package reads, and whether
installed dependencies meet the versions a backend needs."""

from __future__ import annotations

import os
import re
from typing import Optional

BACKEND_ENV = "DLM_KERNELS_BACKEND"
PALLAS_INTERPRET_ENV = "DLM_KERNELS_PALLAS_INTERPRET"


def env_backend() -> Optional[str]:
    value = os.environ.get(BACKEND_ENV, "").strip()
    return value or None


def unmet_requirement(dist: str, dependency: str) -> Optional[str]:
    """Why the installed ``dependency`` does not meet the lower bound that the installed
    ``dist`` declares for it (``dependency>=X.Y``), or None when it does or either is not
    installed as a distribution. jax-triton 0.4 declares triton>=3.7 yet imports with Triton
    3.6 and fails only at its first lowering, with an unrelated TypeError."""
    from importlib import metadata

    try:
        declared, have = metadata.requires(dist) or [], metadata.version(dependency)
    except metadata.PackageNotFoundError:
        return None
    for req in declared:
        if ";" in req:  # conditional (an extra, a platform): never a reason to refuse
            continue
        spec = req.replace(" ", "")
        if spec.startswith(dependency + ">=") and _release(have) < _release(spec.split(">=")[1]):
            return (f"{dist} {metadata.version(dist)} needs {spec}; {dependency} {have} is "
                    "installed")
    return None


def _release(version: str) -> tuple:
    """The leading numeric release of a version string: '3.6.0+git1' -> (3, 6, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()
