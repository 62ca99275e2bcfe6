"""One framework's binding: everything the shared host code needs that differs between torch
and JAX, as one typed object.

The shared layer (``_objectives``, ``token_stats.op``, ``sampling.core`` and
``sampling.upstream``, ``_contract``, the math) never imports torch or jax. Each front end
hands it one ``Framework[A]``, generic in its array type ``A``:

- ``xp``: the ops adapter (``_ops.Ops[A]``), the array operations whose spelling differs,
  head logits (``xp.head_logits``) and the head path's token chunks among them;
- ``vjp``: the token-statistics op's custom VJP from logits and from a head, and the
  vocabulary-parallel collectives' entry points (``VjpAdapter``);
- ``token_stats`` and ``sampling``: the op registries of that framework (``_dispatch``),
  filled when their backends import.

The two bindings are ``dlm_kernels._torch.framework.TORCH`` and
``dlm_kernels._jax.framework.JAX``; tests/test_ops_protocol.py holds both to this type.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from ._ops import Array, Ops
    from ._rows import Rows

#: the front end's array type (torch.Tensor, jax.Array)
A = TypeVar("A", bound="Array")


class OpRegistry(Protocol):
    """What shared code reads of an op's registry (``_dispatch.Registry``; a protocol, so that
    the binding does not import the dispatch layer, whose protocols name the ops' types)."""

    def resolve(self, backend: str | None, platform: str) -> Any:
        """The implementation ``backend`` (None = auto) names on ``platform``."""
        ...


class VjpAdapter(Protocol):
    """What a framework's autodiff adds to the token-statistics op: its custom-VJP mechanics
    and its collectives (each member a static method of the framework's class)."""

    #: whether the framework can write a gradient into its logits (torch: yes; JAX: no)
    inplace_grad: bool

    def apply(self, impl: Any, cfg: Any, rows: Rows, inplace: bool, shard: Any, /) -> Any:
        """(lse, logp, entropy, kl) [N] of rows of arrays, differentiable: the framework's
        custom VJP around ``impl.forward`` / ``impl.backward`` (``cfg``: the call lowered
        once, ``lowering.Lowered``; with a vocabulary ``shard``, the partial states merged by
        the collectives)."""
        ...

    def apply_head(self, impl: Any, cfg: Any, rows: Rows, shard: Any, coefficients: Any,
                   /) -> Any:
        """(lse, logp, entropy, kl, total) of rows whose logits and/or teacher are a
        ``LinearHead``: token chunks of matmuls feeding ``impl``; ``total`` is None without
        ``coefficients``, else the planned scalar with its gradient formed in the forward
        (``linear_head.head``)."""
        ...

    def check_shard(self, shard: Any, /, bound: bool = True) -> None:
        """Raises unless ``shard`` is a process group / mesh axis name (``bound``: also one
        the call can use here, e.g. a JAX axis of the enclosing ``shard_map``)."""
        ...

    def shards(self, shard: Any, /) -> int:
        """How many vocabulary shards a process group / mesh axis splits the logits into."""
        ...


@dataclasses.dataclass(frozen=True)
class Framework(Generic[A]):
    """One framework's binding for the shared host code (module docstring)."""

    #: 'torch' or 'jax'
    name: str
    #: the ops adapter: the class of static methods itself, never an instance
    xp: Ops[A]
    #: the token-statistics op's custom VJP and collectives
    vjp: VjpAdapter
    #: the token-statistics op's backends for this framework
    token_stats: OpRegistry
    #: the denoising step's sampler backends for this framework
    sampling: OpRegistry
