"""Input validation shared by both front ends.

Static checks (rank, shape, dtype) read only ``.shape`` and ``.dtype`` and are safe under
tracing. Value checks run only on concrete arrays (``xp.concrete(x)`` returns None for a
tracer) and look at active positions only; scoring calls never pull an accelerator array to
the host unless the caller asked for it with :func:`sync_checks`. Every error names the
argument (for a pytree leaf, its path) and what was seen, as plain numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar, overload

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from ._ops import Array, Ops, Typed

#: the front end's array type (torch.Tensor, jax.Array): ``_ops.A``
A = TypeVar("A", bound="Array")


def is_real_scalar(value) -> bool:
    """A Python int/float, or a 0-d array that converts to a float (not a tracer)."""
    if isinstance(value, (int, float)):
        return True
    # numpy / framework 0-d scalars that convert exactly.
    if getattr(value, "shape", None) == ():
        try:
            float(value)
        except Exception:  # a tracer, or not a number
            return False
        return True
    return False


def plain(value) -> str:
    """A number as a user writes it: ``-1.0``, ``nan``, ``7`` (not ``np.float64(-1.0)``);
    anything else as its repr."""
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    if getattr(value, "shape", None) == () and is_real_scalar(value):  # a 0-d array
        return plain(value.item())
    return repr(value)


def shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


class OutOfRangeError(ValueError, RuntimeError):
    """A value outside its range where the upstream code raises ``RuntimeError`` (from a
    torch op): both our ValueError and upstream's RuntimeError, so either ``except`` catches
    it."""


class IdOutOfRangeError(OutOfRangeError):
    """An id outside its vocabulary where upstream fails in torch's ``one_hot`` and
    ``gather`` (Megatron-Bridge's DiffusionGemma losses)."""


class _SyncChecks:
    """Whether value checks may synchronise with an accelerator (a plain attribute:
    torch.compile guards attribute reads; process-wide, like a logging level)."""

    enabled = False


@contextlib.contextmanager
def sync_checks(enabled: bool = True) -> Iterator[None]:
    """Within this block, the value checks of every objective also run on accelerator arrays
    (CUDA tensors, JAX arrays on a GPU or TPU) by copying the checked ``[B, L]`` arrays to the
    host: one device synchronisation per checked array. Outside it, a bad id or weight on an
    accelerator is not checked and shows as a NaN loss (see the README). Arrays traced under
    ``jit`` or ``torch.compile`` have no values to check either way."""
    previous = _SyncChecks.enabled
    _SyncChecks.enabled = flag("enabled", enabled)
    try:
        yield
    finally:
        _SyncChecks.enabled = previous


def host_values(xp: Ops[A], x: A, allow_sync: bool = False) -> NDArray[Any] | None:
    """x as a NumPy array (float64 for floats) when its values can be read here, else None:
    never for a tracer; for an accelerator array only when ``allow_sync`` or inside
    ``sync_checks()``."""
    return xp.concrete(x, allow_sync or _SyncChecks.enabled)


def _index(idx) -> str:
    return "(" + ", ".join(str(int(i)) for i in idx) + ("," if len(idx) == 1 else "") + ")"


def dtype_str(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__)).replace("torch.", "")


# -- Python-level arguments: numbers and flags --------------------------------------------

def _static(name, value, what):
    """The message for a traced value (a JAX tracer under jit, grad or vmap) given where a
    static Python ``what`` configures the call, or None when ``value`` is not traced."""
    if not any(cls.__name__ == "Tracer" for cls in type(value).__mro__):
        return None
    return (f"{name} must be a static Python {what}; got a traced value ({type(value).__name__}"
            f"): under jax.jit pass it as a static argument (static_argnums / static_argnames) "
            f"or close over it, rather than as a traced array")


def _item(value):
    """A NumPy scalar's or a 0-d array's Python value (bool, int, float, ...); anything else
    (a traced value too: a JAX tracer has no value here) as it is."""
    if isinstance(value, (int, float)) or _static("", value, "number"):
        return value  # the common case, and all torch.compile traces
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        try:
            return value.item()
        except Exception:  # not a number
            pass
    return value


@overload
def as_number(value: object, integer: Literal[True]) -> int | None: ...


@overload
def as_number(value: object, integer: bool = False) -> float | None: ...


def as_number(value: object, integer: bool = False) -> float | None:
    """The one reader of numbers in both front ends: ``value`` as a Python int
    (``integer``) or float, or None when it is not one. A Python int or float, a NumPy
    integer or floating scalar (``np.int64(13)``, ``np.float32(0.5)``) or a 0-d array of such
    a dtype (NumPy, or a concrete 0-d tensor / JAX array, of either framework) is the number
    it holds. A bool is not a number (``True == 1`` in Python), nor a float where an int is
    meant, nor a traced value."""
    item = _item(value)
    if isinstance(item, bool):
        return None
    if isinstance(item, int):
        return int(item) if integer else float(item)
    if isinstance(item, float) and not integer:
        return float(item)  # np.float64 is a float
    return None


@overload
def number(name: str, value: object, what: str, *, integer: Literal[True]) -> int: ...


@overload
def number(name: str, value: object, what: str, *, integer: bool = False) -> float: ...


def number(name: str, value: object, what: str, *, integer: bool = False) -> float:
    """``value`` as a Python int (``integer``) or float (``as_number``), for a scalar argument
    whose range the caller checks; anything else raises ValueError ``{name} must be {what};
    got ...`` (for a traced value: that it must be static)."""
    out = as_number(value, integer)
    if out is not None:
        return out
    traced = _static(name, value, "number")
    if traced:
        raise ValueError(traced)
    if isinstance(_item(value), bool):
        raise ValueError(f"{name} must be {what}, not a bool; got {_item(value)}")
    raise ValueError(f"{name} must be {what}; got {plain(value)}")


def flag(name, value) -> bool:
    """An on/off argument: True or False (a NumPy bool too). Anything else is a TypeError: a
    truthy ``"no"`` or ``1`` would silently switch the option on."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    traced = _static(name, value, "bool")
    raise TypeError(traced or f"{name} must be True or False; got {plain(value)}")


# -- arrays ------------------------------------------------------------------------------

_LIBRARIES = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "numpy": "numpy"}


def array_library(x):
    """"torch", "jax" or "numpy" for an array of that library, else None: read from the
    type's module, so nothing is imported (``dlm_kernels.torch`` never imports JAX, nor
    ``dlm_kernels.jax`` torch)."""
    if not hasattr(x, "shape"):
        return None
    return _LIBRARIES.get(type(x).__module__.split(".")[0])


#: what each front end's array arguments are, in Tunix's words for JAX
_ARRAYS = {"torch": "a torch tensor", "jax": "a JAX/NumPy array or ShapeDtypeStruct"}


def _wrong_library(xp: Ops[Any], name: str, x: object) -> str | None:
    """The message for an array of a library this front end does not take, or None."""
    library = array_library(x)
    if library is None or library == xp.framework:
        return None
    got = {"torch": "a torch Tensor", "jax": "a JAX Array",
           "numpy": f"a NumPy {type(x).__name__}"}[library]
    if xp.framework == "torch":
        convert = "torch.from_dlpack" if library == "jax" else "torch.as_tensor"
        return (f"{name} must be a torch tensor (dlm_kernels.torch takes torch tensors); got "
                f"{got}: convert it with {convert}({name})")
    return (f"{name} must be {_ARRAYS['jax']} (dlm_kernels.jax takes JAX arrays); got "
            f"{got}: convert it with jnp.from_dlpack({name}.detach()), or "
            f"jnp.asarray({name}.detach().cpu().numpy())")


def require_array(xp: Ops[Any], name: str, x: object) -> None:
    if not xp.is_array(x):
        raise TypeError(_wrong_library(xp, name, x)
                        or f"{name} must be {_ARRAYS[xp.framework]}; got {type(x).__name__}")


def require_instance(name, value, cls):
    """value a ``cls`` (a contract class of one front end); a same-named class of the other
    front end is named with its module, and the class to build instead."""
    if isinstance(value, cls):
        return
    got = type(value)
    if got.__name__ == cls.__name__ and got.__module__ != cls.__module__:
        raise TypeError(f"{name} must be a {cls.__name__} of {cls.__module__}; got "
                        f"{got.__module__}.{got.__name__}: build the batch with "
                        f"{cls.__module__}.{cls.__name__}.create(...)")
    raise TypeError(f"{name} must be a {cls.__name__}; got {got.__name__}")


def require_logits(xp: Ops[Any], name: str, source) -> None:
    """A logits argument, given as its source (``linear_head.head.as_logits`` of it: an array
    or a ``LinearHead``, its parts checked). The checks that take logits read only the
    ``LogitsSource`` protocol; their callers resolve the argument, so this module imports
    nothing above it."""
    source.check(xp, name)


def require_rank(xp: Ops[Any], name: str, x, rank: int, layout: str,
                 logits: bool = False) -> None:
    """x an array of rank ``rank`` (``logits``: x is a logits source, ``require_logits``)."""
    (require_logits if logits else require_array)(xp, name, x)
    if len(x.shape) != rank:
        raise ValueError(f"{name} must have shape {layout}; got {shape_str(x.shape)}")


def require_int(xp: Ops[Any], name: str, x: Typed) -> None:
    if not xp.is_int(x):
        raise TypeError(f"{name} must have an integer dtype; got {dtype_str(x)}")


def require_float(xp: Ops[Any], name: str, x: Typed) -> None:
    if not xp.is_float(x):
        raise TypeError(f"{name} must have a floating-point dtype; got {dtype_str(x)}")


def require_real(xp: Ops[Any], name: str, x: Typed,
                 what: str = "a real numeric or boolean dtype (bool, integer or floating)"
                 ) -> None:
    if not xp.is_real(x):
        raise TypeError(f"{name} must have {what}; got {dtype_str(x)}")


def require_shape(name, x, shape, layout):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {layout} = {shape_str(shape)}; got {shape_str(x.shape)}"
        )


# -- value checks (concrete arrays only) ----------------------------------------------------

def _raise_first(bad: NDArray[Any], values: NDArray[Any], message: str,
                 error: type[Exception] = ValueError) -> NoReturn:
    idx = tuple(np.argwhere(bad)[0])
    raise error(f"{message}; got {plain(values[idx])} at index {_index(idx)}")


def check_nonnegative(xp: Ops[A], name: str, x: A, allow_sync: bool = False) -> bool:
    """Every value finite, then every value >= 0 (weights, masks), in Tunix's words. Returns
    whether the values were read (False: they could not be, nothing was checked)."""
    v = host_values(xp, x, allow_sync)
    if v is None:
        return False
    if not np.isfinite(v).all():
        _raise_first(~np.isfinite(v), v, f"{name} must contain only finite values")
    if (v < 0).any():
        _raise_first(v < 0, v, f"{name} must be nonnegative")
    return True


def check_unit_interval(xp: Ops[A], name: str, x: A, allow_sync: bool = False) -> None:
    """Every value in [0, 1] (diffusion times); NaN is out of range."""
    v = host_values(xp, x, allow_sync)
    if v is None:
        return
    bad = ~((v >= 0) & (v <= 1))
    if bad.any():
        _raise_first(bad, v, f"{name} must lie in [0, 1]")


#: the float32 range a sum of weights must lie in: a WeightedSum's gradient scales by
#: 1 / Σ w, which overflows below the smallest normal number, and Σ w itself overflows above
#: the largest
F32_TINY, F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def check_weight_sum(xp: Ops[A], name: str, x: A, per_row: bool = False,
                     allow_sync: bool = False) -> None:
    """Σ x (per row of the last axis with ``per_row``, else in all) is 0 or within float32's
    normal range (``per_row``: only finite, for sums that divide as max(Σ, 1))."""
    v = host_values(xp, x, allow_sync)
    if v is None:
        return
    sums = v.sum(axis=-1) if per_row else v.sum()[None]  # float64: no overflow here
    bad = (sums > F32_MAX) | ((sums > 0) & (sums < F32_TINY) & (not per_row))
    if bad.any():
        idx = np.argwhere(bad)[0]
        where = f" at row {_index(idx)}" if per_row else ""
        raise ValueError(
            f"{name} must sum to 0 or to a normal float32 number (between {F32_TINY:.3g} and "
            f"{F32_MAX:.3g}: the loss divides by the sum); got a sum of "
            f"{float(sums[tuple(idx)]):.3g}{where}: rescale them")


def check_finite(xp: Ops[A], name: str, x: A, where: A | None = None, at: str = "",
                 allow_sync: bool = False) -> None:
    """Every value of ``x`` finite, at the positions where ``where`` (an array whose non-zero
    entries select) is set, or everywhere when ``where`` is None; ``at`` says which positions
    in the message (" where loss_weights is set")."""
    v = host_values(xp, x, allow_sync)
    if v is None:
        return
    bad = ~np.isfinite(v)
    if where is not None:
        w = host_values(xp, where, allow_sync)
        if w is None:
            return
        bad = bad & (w != 0)
    if bad.any():
        _raise_first(bad, v, f"{name}{at} must be finite")


def check_ids(xp: Ops[A], name: str, ids: A, high: int | None = None, where: A | None = None,
              at: str = "", allow_sync: bool = False,
              error: type[Exception] = ValueError) -> None:
    """ids in [0, high) (>= 0 when high is None) at the positions where ``where`` (an array
    whose non-zero entries select) is set, or everywhere when ``where`` is None; ``at`` says
    which positions in the message (" where loss_mask is set"); ``error`` the class raised."""
    y = host_values(xp, ids, allow_sync)
    if y is None:
        return
    bad = (y < 0) if high is None else ((y < 0) | (y >= high))
    if where is not None:
        w = host_values(xp, where, allow_sync)
        if w is None:
            return
        bad = bad & (w != 0)
    if bad.any():
        bound = ">= 0" if high is None else f"in [0, {high})"
        _raise_first(bad, y, f"{name}{at} must be {bound}", error)


def check_active_targets(xp: Ops[A], target_ids: A, loss_weights: A,
                         vocab_size: int | None = None, allow_sync: bool = False) -> None:
    """Active targets (non-zero weight) >= 0, then < ``vocab_size`` when it is given, in
    Tunix's words (its batch checks the first, its logits validation the second)."""
    y = host_values(xp, target_ids, allow_sync)
    if y is None:
        return
    w = host_values(xp, loss_weights, allow_sync)
    if w is None:
        return
    active = w != 0
    if ((y < 0) & active).any():
        _raise_first((y < 0) & active, y, "active target_ids must be nonnegative")
    if vocab_size is not None and ((y >= vocab_size) & active).any():
        _raise_first((y >= vocab_size) & active, y,
                     f"active target_ids must be smaller than vocabulary size {vocab_size}")


# -- the token-statistics primitive ------------------------------------------------

def check_stats_inputs(xp: Ops[A], logits, targets: A, weights: A | None, shift_ids: A | None,
                       shift, teacher_logits) -> None:
    """Static checks of ``token_stats`` arguments (leading dims ``...`` = rows; ``logits``
    and ``teacher_logits`` as sources, ``require_logits``)."""
    require_logits(xp, "logits", logits)
    if len(logits.shape) < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., K] with K >= 1; got {shape_str(logits.shape)}")
    require_float(xp, "logits", logits)
    rows = tuple(logits.shape[:-1])
    require_array(xp, "targets", targets)
    require_int(xp, "targets", targets)
    require_shape("targets", targets, rows, "logits.shape[:-1]")
    if weights is not None:
        require_array(xp, "weights", weights)
        require_shape("weights", weights, rows, "logits.shape[:-1]")
    if (shift_ids is None) != (shift is None):
        raise ValueError("shift_ids and shift must be given together (LOO shift); got only one")
    if shift_ids is not None:
        require_array(xp, "shift_ids", shift_ids)
        require_int(xp, "shift_ids", shift_ids)
        require_shape("shift_ids", shift_ids, rows, "logits.shape[:-1]")
        if xp.is_array(shift):
            require_float(xp, "shift", shift)
            if tuple(shift.shape) not in ((), rows):
                raise ValueError(
                    f"shift must be a scalar or have shape logits.shape[:-1] = {shape_str(rows)}; "
                    f"got {shape_str(shift.shape)}"
                )
        elif getattr(shift, "shape", ()) != ():  # an array of another library: say which
            require_array(xp, "shift", shift)
        else:  # a number (a NumPy scalar or a 0-d array too)
            number("shift", shift, "a float or a floating array")
    if teacher_logits is not None:
        require_logits(xp, "teacher_logits", teacher_logits)
        require_float(xp, "teacher_logits", teacher_logits)
        require_shape("teacher_logits", teacher_logits, logits.shape, "logits.shape")


# -- the Tunix batch contract --------------------------------------------------------

def check_model_inputs(xp: Ops[Any], model_inputs, batch_size: int) -> None:
    """A batch-major pytree of arrays: at least one leaf; every leaf an array (not a scalar)
    of a bool or real numeric dtype whose leading dimension is ``batch_size``."""
    leaves = xp.leaves_with_paths(model_inputs)
    if not leaves:
        raise ValueError(
            f"model_inputs must contain at least one array (a pytree with an array leaf); "
            f"got {type(model_inputs).__name__} with none")
    for path, leaf in leaves:
        name = "model_inputs" + path
        require_array(xp, name, leaf)
        if len(leaf.shape) == 0:
            raise ValueError(f"{name} must be batch-major, not scalar: [B, ...] with "
                             f"B = {batch_size}; got shape []")
        if leaf.shape[0] != batch_size:
            raise ValueError(
                f"{name} has batch size {leaf.shape[0]}; expected {batch_size} "
                f"(target_ids.shape[0]): it must be batch-major [B, ...]; got shape "
                f"{shape_str(leaf.shape)}")
        require_real(xp, name, leaf)


def check_token_batch_static(xp: Ops[A], model_inputs, target_ids: A, loss_weights: A) -> None:
    require_rank(xp, "target_ids", target_ids, 2, "[batch, length]")
    require_int(xp, "target_ids", target_ids)
    require_array(xp, "loss_weights", loss_weights)
    if tuple(loss_weights.shape) != tuple(target_ids.shape):
        raise ValueError(f"loss_weights must match target_ids shape {shape_str(target_ids.shape)}"
                         f"; got {shape_str(loss_weights.shape)}")
    require_real(xp, "loss_weights", loss_weights)
    check_model_inputs(xp, model_inputs, target_ids.shape[0])


def check_token_batch_values(xp: Ops[A], target_ids: A, loss_weights: A,
                             vocab_size: int | None = None, allow_sync: bool = True) -> bool:
    """Finite non-negative weights; active targets in [0, K) (K when known). Returns whether
    the weights were read (and so checked).

    Scoring calls pass ``allow_sync=False``: accelerator arrays are then not pulled to the
    host (an out-of-range active target still shows as a NaN log-prob, never silently).
    """
    read = check_nonnegative(xp, "loss_weights", loss_weights, allow_sync)
    check_weight_sum(xp, "loss_weights", loss_weights, allow_sync=allow_sync)
    check_active_targets(xp, target_ids, loss_weights, vocab_size, allow_sync)
    return read


def check_logits_for_batch(xp: Ops[Any], name: str, logits, batch_shape: tuple[int, ...]
                           ) -> None:
    """Logits [B, L, K] (a source, ``require_logits``) for a batch of shape ``batch_shape``,
    in Tunix's words and order (rank, alignment, a non-empty vocabulary, a floating dtype)."""
    require_rank(xp, name, logits, 3, "[batch, length, vocab]", logits=True)
    if tuple(logits.shape[:2]) != tuple(batch_shape):
        raise ValueError(
            f"{name} must align with target_ids on [batch, length] = {shape_str(batch_shape)}; "
            f"got shape {shape_str(logits.shape)}"
        )
    if logits.shape[2] < 1:
        raise ValueError(f"{name} must have a non-empty vocabulary dimension; got shape "
                         f"{shape_str(logits.shape)}")
    require_float(xp, name, logits)


def check_teacher_values(xp: Ops[A], teacher_logits, loss_weights: A) -> None:
    """Teacher logits (a source, ``require_logits``) must be finite at active positions
    (``LogitsSource.check_finite``: a head's are never built, nothing to read)."""
    teacher_logits.check_finite(xp, "teacher_logits", loss_weights)


def require_finite_at_active(xp: Ops[A], name: str, logits: A, weights: A) -> None:
    """Logits [..., K] must be finite at the rows of nonzero ``weights`` [...] (concrete host
    arrays only, unless inside ``sync_checks()``: a scoring call never syncs an accelerator
    by default; a non-finite teacher there gives a NaN loss)."""
    w = host_values(xp, weights)
    if w is None:
        return
    # first each row's sum (one read of the logits, [...] floats to the host, no [..., K]
    # float64 copy): a row with a NaN or inf sums to one; a finite row whose sum overflows
    # is checked in full below
    sums = host_values(xp, xp.rowsum(logits))
    if sums is None or np.isfinite(sums)[w != 0].all():
        return
    u = host_values(xp, logits)  # [..., K] float64: only when a row may be bad
    assert u is not None  # readable as its row sums were: the same array, device, tracing
    bad = ~np.isfinite(u) & (w != 0)[..., None]
    if bad.any():
        _raise_first(bad, u, f"active {name} must contain only finite values")
