"""Backends: the protocols, the one table of them, and the registries the ops fill.

A backend name is one row of :data:`BACKENDS`: its name, its token-statistics module per
framework and the platforms where auto prefers it. Each op (token statistics, the sampler,
the fused linear head) has its own :class:`Op`: the protocol its implementations follow
(checked when one registers) and its module per backend and framework, each defining
``IMPLEMENTATION``. A :class:`Registry` holds one op's implementations for one framework
(``registry(op, framework)``). Everything else (the names ``backend=`` accepts, auto
preference, the documentation's list, the benchmark's backend lists) is read from the
table, and resolving is written once here for every op. A module that cannot import is
recorded with why (``mark_unavailable``), so an explicit request can say so.
``backend=None`` means auto: the first registered backend in the platform's preference that
supports the array, or the ``DLM_KERNELS_BACKEND`` environment variable when set. Auto
never changes path silently: every fallback is logged on the ``dlm_kernels`` logger (at
DEBUG, except the first time an accelerator's own kernels are missing for a framework: a
WARNING, since the fallback there is much slower), and ``backend_for(...)`` tells the
choice.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import inspect
from typing import (TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Protocol, Tuple,
                    runtime_checkable)

from ._env import BACKEND_ENV, env_backend

if TYPE_CHECKING:  # the protocol's types; the modules that define them import this one
    from .token_stats.lowering import Lowered
    from ._rows import Rows
    from .linear_head.head import HeadPlan
    from .sampling.core import Sample, SampleConfig
    from .token_stats.formulas import State, Stats

logger = logging.getLogger("dlm_kernels")

FALLBACK = "chunked"  # what auto uses where no platform prefers another backend


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an implementation offers beyond the base protocol (the registry and the front
    ends read these; nothing is probed with getattr)."""

    dtypes: Tuple[str, ...] = ("float32", "bfloat16", "float16")  # logits it accepts
    vocab_shards: bool = False  # forward_partial + backward(offset=): vocabulary parallelism
    inplace_grad: bool = False  # backward(inplace=True) writes d(logits) into the logits


#: the framework-native backends also take float64 logits (their math is float32 all the same)
NATIVE_DTYPES = ("float32", "bfloat16", "float16", "float64")


Array = Any  # a framework's array (torch.Tensor, jax.Array): this module imports neither
Grads = Tuple[Array, ...]  # the row cotangents of the returned statistics (PUBLIC_STATS), [N] f32


@runtime_checkable
class Backend(Protocol):
    """One framework's implementation of the token-statistics primitive, in full (``rows``:
    the row bundle of ``_rows.Rows``; ``cfg``: the call lowered once by the front end,
    ``token_stats.lowering.Lowered``, the only place its flags and constants come from; ``Stats``,
    ``State``: ``token_stats.formulas``). What an implementation offers is declared, never
    probed, and the registry checks the declaration when it takes one (``missing_methods``):

    custom_vjp False: ``compute`` only, differentiated by the framework's autodiff.
    custom_vjp True: ``forward`` and ``backward``; with ``capabilities.vocab_shards`` also
    ``forward_partial`` and ``backward(..., offset=)``; with ``inplace_grad``,
    ``backward(..., inplace=True)``. Every custom-VJP backend runs linear heads too (the
    front end feeds it token chunks of ``hidden @ weight``, ``dlm_kernels.linear_head.head``;
    kernels that run a whole head in one pass are the head op's, :class:`FusedHead`).
    Implementations derive from :class:`BackendBase`, whose methods raise for what the
    capabilities leave out. The sampler is its own op (:class:`SampleBackend`).
    """

    name: str
    capabilities: Capabilities
    custom_vjp: bool

    def unsupported_reason(self, platform: str) -> Optional[str]:
        """None when it runs on arrays of ``platform``, else why not."""
        ...

    def compute(self, rows: Rows, cfg: Lowered) -> Tuple[Array, Array, Array, Array]:
        """(lse, logp, entropy, kl), each [N] float32 (custom_vjp False)."""
        ...

    def forward(self, rows: Rows, cfg: Lowered) -> Stats[Array]:
        """Stats of [N] float32 fields: the outputs and what the backward reads."""
        ...

    def forward_partial(self, rows: Rows, cfg: Lowered,
                        offset: int = 0) -> Tuple[State[Array], Array, Array]:
        """(State, r_y, found) of a vocabulary shard starting at column ``offset``."""
        ...

    def backward(self, rows: Rows, stats: Stats[Array], grads: Grads, cfg: Lowered,
                 **options: Any) -> Tuple[Array, Optional[Array]]:
        """(d_logits, d_teacher or None) from the row cotangents ``grads``; ``options``:
        ``offset: int = 0`` (vocab_shards), ``inplace: bool = False`` (inplace_grad)."""
        ...


class BackendBase:
    """What every token-statistics implementation derives from: the methods its capabilities
    leave out, each raising NotImplementedError with the backend's name (the front ends
    consult ``capabilities`` and ``custom_vjp`` first, so a user sees these only through a
    bug)."""

    name: str = "?"

    def _missing(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"backend {self.name!r} does not implement {what}")

    def unsupported_reason(self, platform: str) -> Optional[str]:
        raise self._missing("unsupported_reason")

    def compute(self, rows: Rows, cfg: Lowered) -> Tuple[Array, Array, Array, Array]:
        raise self._missing("compute (it has a custom VJP: forward / backward)")

    def forward(self, rows: Rows, cfg: Lowered) -> Stats[Array]:
        raise self._missing("forward (no custom VJP: compute)")

    def forward_partial(self, rows: Rows, cfg: Lowered,
                        offset: int = 0) -> Tuple[State[Array], Array, Array]:
        raise self._missing("forward_partial (capabilities.vocab_shards is False)")

    def backward(self, rows: Rows, stats: Stats[Array], grads: Grads, cfg: Lowered,
                 **options: Any) -> Tuple[Array, Optional[Array]]:
        raise self._missing("backward (no custom VJP: compute)")


@runtime_checkable
class SampleBackend(Protocol):
    """One framework's implementation of the denoising step's draw (``sample_tokens``), in
    full; the registry checks it when it takes one (``missing_sample_methods``)."""

    name: str

    def unsupported_reason(self, platform: str) -> Optional[str]:
        """None when it runs on arrays of ``platform``, else why not."""
        ...

    def sample(self, z: Array, zu: Optional[Array], keys: Array, suppress: Optional[Array],
               cfg: SampleConfig) -> Sample:
        """The Sample of [N, K] logits z (zu: the unconditional logits of guidance; keys:
        [N] uint32 row keys; suppress: ids never drawn), ``dlm_kernels.sampling.core``."""
        ...


@runtime_checkable
class FusedHead(Protocol):
    """Kernels that run a whole linear head in one pass each way (JAX's pallas backend:
    ``linear_head.jax_pallas``), found by the token-statistics backend's name; ``rows.logits``
    is the ``LinearHead``. The registry checks one when it takes it
    (``missing_head_methods``)."""

    name: str

    def takes(self, rows: Rows, axis: Any, plan: HeadPlan) -> bool:
        """Whether the kernels take these rows (else the token-chunked sweep runs)."""
        ...

    def forward(self, rows: Rows, cfg: Lowered) -> Stats[Array]:
        """Stats of [N] float32 fields."""
        ...

    def backward(self, rows: Rows, stats: Stats[Array], grads: Grads,
                 cfg: Lowered) -> Tuple[Tuple[Array, Array, Optional[Array]], Optional[Array]]:
        """((dH, dW, db or None), the teacher's gradient or None)."""
        ...


#: what each declaration promises: (method, the parameters it must take besides self)
_PROMISES = {
    "compute": ("rows", "cfg"),
    "forward": ("rows", "cfg"),
    "backward": ("rows", "stats", "grads", "cfg"),
    "forward_partial": ("rows", "cfg", "offset"),
}
_SAMPLE_PROMISES = {"unsupported_reason": ("platform",),
                    "sample": ("z", "zu", "keys", "suppress", "cfg")}
_HEAD_PROMISES = {"takes": ("rows", "axis", "plan"), "forward": ("rows", "cfg"),
                  "backward": ("rows", "stats", "grads", "cfg")}


def _takes_no(method: str, function: Callable[..., Any],
              params: Tuple[str, ...]) -> list[str]:
    have = inspect.signature(function).parameters
    return [f"{method} (takes no {p!r})" for p in params if p not in have]


def missing_methods(impl: Backend) -> Tuple[str, ...]:
    """What ``impl`` declares (``custom_vjp``, ``capabilities``) but does not implement: a
    method left to :class:`BackendBase`'s raising stub, or taking other parameters than the
    protocol's. Empty when it follows :class:`Backend` in full."""
    cls, caps = type(impl), impl.capabilities
    methods = {  # method -> (the class's, the base's stub)
        "unsupported_reason": (cls.unsupported_reason, BackendBase.unsupported_reason),
        "compute": (cls.compute, BackendBase.compute),
        "forward": (cls.forward, BackendBase.forward),
        "backward": (cls.backward, BackendBase.backward),
        "forward_partial": (cls.forward_partial, BackendBase.forward_partial),
    }
    wanted = ["unsupported_reason"] + (["forward", "backward"] if impl.custom_vjp else ["compute"])
    wanted += ["forward_partial"] * caps.vocab_shards
    problems = []
    for method in wanted:
        own, stub = methods[method]
        if own is stub:
            problems.append(f"{method} (not implemented)")
            continue
        problems += _takes_no(method, own, _PROMISES.get(method, ()))
    backward = inspect.signature(cls.backward).parameters
    for declared, option in ((caps.vocab_shards and impl.custom_vjp, "offset"),
                             (caps.inplace_grad, "inplace")):
        if declared and option not in backward:
            problems.append(f"backward (takes no {option!r})")
    return tuple(problems)


def _lacks(impl: Any, promises: Dict[str, Tuple[str, ...]]) -> Tuple[str, ...]:
    """What of ``promises`` (method -> its parameters) the class of ``impl`` does not
    implement, or implements with other parameters."""
    members = dict(inspect.getmembers(type(impl)))
    problems = []
    for method, params in promises.items():
        own = members.get(method)
        if not callable(own):
            problems.append(f"{method} (not implemented)")
            continue
        problems += _takes_no(method, own, params)
    return tuple(problems)


def missing_sample_methods(impl: SampleBackend) -> Tuple[str, ...]:
    """What of :class:`SampleBackend` ``impl`` does not implement. Empty when it follows it
    in full."""
    return _lacks(impl, _SAMPLE_PROMISES)


def missing_head_methods(impl: FusedHead) -> Tuple[str, ...]:
    """What of :class:`FusedHead` ``impl`` does not implement. Empty when it follows it in
    full."""
    return _lacks(impl, _HEAD_PROMISES)


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """One row of the backend table."""

    name: str
    modules: Dict[str, str]  # framework ("torch", "jax") -> its token-statistics module
    preferred_on: Tuple[str, ...]  # platforms of the logits where auto tries it first
    summary: str  # one line for the documentation


#: The backend table: a new backend is a row here and a module per framework and op.
BACKENDS: Tuple[BackendSpec, ...] = (
    BackendSpec("reference", {"torch": "dlm_kernels.token_stats.torch_reference",
                              "jax": "dlm_kernels.token_stats.jax_reference"}, (),
                "plain framework ops, float32, full materialisation, framework autodiff"),
    BackendSpec("chunked", {"torch": "dlm_kernels.token_stats.torch_chunked",
                            "jax": "dlm_kernels.token_stats.jax_chunked"}, (),
                "framework ops over vocabulary chunks with a custom VJP, on every device"),
    BackendSpec("triton", {"torch": "dlm_kernels.token_stats.torch_triton",
                           "jax": "dlm_kernels.token_stats.jax_triton"}, ("cuda", "gpu"),
                "Triton kernels on NVIDIA GPUs, JAX through jax-triton"),
    BackendSpec("pallas", {"jax": "dlm_kernels.token_stats.jax_pallas"}, ("tpu",),
                "Pallas Mosaic kernels on TPUs"),
)


def backend_names() -> Tuple[str, ...]:
    return tuple(spec.name for spec in BACKENDS)


def auto_preference(platform: str) -> Tuple[str, ...]:
    """The backends auto tries on ``platform``, best first: those that prefer it, then the
    fallback."""
    return tuple(s.name for s in BACKENDS if platform in s.preferred_on) + (FALLBACK,)


def backends_doc() -> str:
    """The ``backend=`` line of the documentation, from the table."""
    names = ", ".join(f'"{s.name}" ({s.summary})' for s in BACKENDS)
    return f"None (auto), or one of {names}"


@dataclasses.dataclass(frozen=True)
class Op:
    """One op's registries: the check of its protocol and where its implementations live."""

    name: str  # in messages: "token-statistics", "sampler", "fused-head"
    check: Callable[[Any], Tuple[str, ...]]  # what an implementation lacks of the protocol
    # backend name (a row of BACKENDS) -> framework -> module defining IMPLEMENTATION;
    # None: the backend table's own modules (token statistics)
    modules: Optional[Mapping[str, Mapping[str, str]]] = None

    def module(self, spec: BackendSpec, framework: str) -> Optional[str]:
        """The module of backend ``spec`` for ``framework``, or None where it has none."""
        table = spec.modules if self.modules is None else self.modules.get(spec.name, {})
        return table.get(framework)


#: token statistics (token_stats/): its modules are the backend table's
TOKEN_STATS = Op("token-statistics", missing_methods)

#: the denoising step's draw (sampling/): a module per backend and framework
SAMPLING = Op("sampler", missing_sample_methods, {
    "reference": {"torch": "dlm_kernels.sampling.torch_reference",
                  "jax": "dlm_kernels.sampling.jax_reference"},
    "chunked": {"torch": "dlm_kernels.sampling.torch_chunked",
                "jax": "dlm_kernels.sampling.jax_chunked"},
    "triton": {"torch": "dlm_kernels.sampling.torch_triton",
               "jax": "dlm_kernels.sampling.jax_triton"},
    "pallas": {"jax": "dlm_kernels.sampling.jax_pallas"},
})

#: kernels that run a whole linear head (linear_head/), found by the token-statistics
#: backend's name: JAX's pallas only
FUSED_HEAD = Op("fused-head", missing_head_methods, {
    "pallas": {"jax": "dlm_kernels.linear_head.jax_pallas"},
})


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here; the message says why."""


def higher_order_error(framework: str, backend: str) -> NotImplementedError:
    """The error for differentiating a custom VJP's gradient: the backward formulas of
    docs/design.md §2 are first derivatives, and nothing differentiates them again (a
    NotImplementedError, so a RuntimeError too)."""
    how = ("a backward through a gradient taken with create_graph=True" if framework == "torch"
           else "jax.grad of jax.grad, jax.hessian, a jvp of a vjp")
    return NotImplementedError(
        f"backend {backend!r} gives first derivatives only: its custom VJP cannot be "
        f"differentiated again ({how}). Use backend='reference' for higher-order derivatives "
        f"(the framework's own autodiff over the full [N, K] logits in float32)")


#: (framework, platform, backend) fallbacks already logged as a WARNING: once per
#: framework, whichever op's registry met it first
_WARNED = set()


class Registry:
    """Implementations of one op for one framework."""

    def __init__(self, framework: str, op: Op):
        self.framework, self.op = framework, op
        self.IMPLEMENTATIONS: Dict[str, Any] = {}
        self._unavailable: Dict[str, str] = {}

    def register(self, impl: Any) -> None:
        missing = self.op.check(impl)
        if missing:
            raise TypeError(f"{self.op.name} backend {impl.name!r} ({type(impl).__qualname__}) "
                            f"declares but does not implement: {', '.join(missing)}")
        self.IMPLEMENTATIONS[impl.name] = impl
        self._unavailable.pop(impl.name, None)

    def mark_unavailable(self, name: str, reason: str) -> None:
        if name not in self.IMPLEMENTATIONS:
            self._unavailable[name] = reason

    def available(self) -> Tuple[str, ...]:
        return tuple(self.IMPLEMENTATIONS)

    def load(self) -> None:
        """Import this op's module for this framework of every row of the backend table; each
        defines IMPLEMENTATION. A module that cannot import is recorded with its reason
        instead."""
        for spec in BACKENDS:
            module = self.op.module(spec, self.framework)
            if module is None or spec.name in self.IMPLEMENTATIONS:
                continue
            try:
                self.register(importlib.import_module(module).IMPLEMENTATION)
            except ImportError as err:
                self.mark_unavailable(spec.name, f"import failed ({err})")

    def native(self, platform: str) -> Tuple[str, ...]:
        """The registered backends that auto would consider on ``platform`` and that run
        there, best first (what the benchmark times as "ours")."""
        return tuple(name for name in auto_preference(platform)
                     if name in self.IMPLEMENTATIONS
                     and self.IMPLEMENTATIONS[name].unsupported_reason(platform) is None)

    def _explicit(self, name: str, platform: str):
        if name not in backend_names():
            raise ValueError(f"backend must be None or one of {backend_names()}; got {name!r}")
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
        preference = auto_preference(platform)
        for name in preference:
            impl = self.IMPLEMENTATIONS.get(name)
            if impl is None:
                reason = self._unavailable.get(name, "not registered")
                if name == preference[0] and (self.framework, platform, name) not in _WARNED:
                    _WARNED.add((self.framework, platform, name))  # the platform's own kernels
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
        return self.IMPLEMENTATIONS[FALLBACK]


_REGISTRIES: Dict[Tuple[str, str], Registry] = {}


def registry(op: Op, framework: str) -> Registry:
    """The registry of ``op`` for ``framework``, loaded when first asked for (importing only
    that framework's modules)."""
    key = (op.name, framework)
    if key not in _REGISTRIES:
        _REGISTRIES[key] = Registry(framework, op)
        _REGISTRIES[key].load()
    return _REGISTRIES[key]
