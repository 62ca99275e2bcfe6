"""Backend registry and selection, shared by both front ends.

Each front end owns one :class:`Registry`. A backend module registers its implementation
when it imports; one that cannot import records why (``mark_unavailable``), so an explicit
request can say so. ``backend=None`` means auto: the first registered backend in the
platform's preference list that supports the array, or the ``DLM_KERNELS_BACKEND``
environment variable when set. Auto never changes path silently: every fallback is logged
on the ``dlm_kernels`` logger (at DEBUG, except the first time an accelerator's own kernels
are missing: a WARNING, since the fallback there is much slower), and
``backend_for(...)`` tells the choice.
"""

from __future__ import annotations

import importlib
import logging
from typing import Dict, Optional, Sequence

from ._common import BACKEND_ENV, env_backend

logger = logging.getLogger("dlm_kernels")

KNOWN_BACKENDS = ("reference", "chunked", "triton", "pallas")

#: Auto preference per platform (the platform of the logits array).
AUTO_PREFERENCE: Dict[str, Sequence[str]] = {
    "cuda": ("triton", "chunked"),
    "gpu": ("triton", "chunked"),
    "tpu": ("pallas", "chunked"),
}
DEFAULT_PREFERENCE: Sequence[str] = ("chunked",)


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here; the message says why."""


class Registry:
    """Implementations of the token-statistics primitive for one framework."""

    def __init__(self, framework: str):
        self.framework = framework
        self.IMPLEMENTATIONS: Dict[str, object] = {}
        self._unavailable: Dict[str, str] = {}
        self._warned = set()  # (platform, backend) fallbacks already logged as a WARNING

    def register(self, impl) -> None:
        self.IMPLEMENTATIONS[impl.name] = impl
        self._unavailable.pop(impl.name, None)

    def mark_unavailable(self, name: str, reason: str) -> None:
        if name not in self.IMPLEMENTATIONS:
            self._unavailable[name] = reason

    def available(self) -> tuple:
        return tuple(self.IMPLEMENTATIONS)

    def load(self, modules: Dict[str, str]) -> None:
        """Import each backend module (name -> module path); each defines IMPLEMENTATION.
        A module that cannot import is recorded with its reason instead."""
        for name, module in modules.items():
            try:
                self.register(importlib.import_module(module).IMPLEMENTATION)
            except ImportError as err:
                self.mark_unavailable(name, f"import failed ({err})")

    def _explicit(self, name: str, platform: str):
        if name not in KNOWN_BACKENDS:
            raise ValueError(f"backend must be None or one of {KNOWN_BACKENDS}; got {name!r}")
        impl = self.IMPLEMENTATIONS.get(name)
        if impl is None:
            reason = self._unavailable.get(name, "it is not implemented for this framework")
            raise BackendUnavailableError(
                f"backend={name!r} is not available for {self.framework}: {reason}"
            )
        why = impl.unsupported_reason(platform)
        if why is not None:
            raise BackendUnavailableError(
                f"backend={name!r} cannot run on {self.framework} arrays on platform "
                f"{platform!r}: {why}"
            )
        return impl

    def resolve(self, backend: Optional[str], platform: str):
        """The implementation for ``backend`` (None = auto) on ``platform``."""
        if backend is not None:
            return self._explicit(backend, platform)
        forced = env_backend()
        if forced is not None:
            try:
                return self._explicit(forced, platform)
            except (BackendUnavailableError, ValueError) as err:
                raise BackendUnavailableError(f"{BACKEND_ENV}={forced!r}: {err}") from err
        preference = AUTO_PREFERENCE.get(platform, DEFAULT_PREFERENCE)
        for name in preference:
            impl = self.IMPLEMENTATIONS.get(name)
            if impl is None:
                reason = self._unavailable.get(name, "not registered")
                if name == preference[0] and (platform, name) not in self._warned:
                    self._warned.add((platform, name))  # the platform's own kernels: once
                    logger.warning(
                        "%s arrays on %r: backend %r is unavailable (%s); using the slower "
                        "chunked fallback. Set %s=chunked to choose it explicitly.",
                        self.framework, platform, name, reason, BACKEND_ENV)
                else:
                    logger.debug("auto backend: %s unavailable for %s (%s); trying the next",
                                 name, self.framework, reason)
                continue
            why = impl.unsupported_reason(platform)
            if why is None:
                return impl
            logger.debug("auto backend: %s skipped on %s: %s", name, platform, why)
        return self.IMPLEMENTATIONS["chunked"]
