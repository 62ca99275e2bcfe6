"""The custom VJPs' gradients, guarded against a second differentiation.

Under ``create_graph=True`` autograd records a custom backward so its result can be
differentiated again. The backward formulas (docs/design.md §2) are first derivatives and
run without recording (their saved row statistics carry no graph), so such a gradient would
look constant: a later backward through it would silently miss the second-order terms.
``first_order_only`` attaches a node to those gradients whose own backward raises instead.
"""

from __future__ import annotations

import torch

from .._dispatch import higher_order_error


class _FirstOrderOnly(torch.autograd.Function):
    """Passes ``n`` gradients through unchanged; differentiating them raises."""

    @staticmethod
    def forward(ctx, backend, n, *tensors):  # tensors: the n gradients, then their inputs
        ctx.backend = backend
        return tuple(g.detach() for g in tensors[:n])

    @staticmethod
    def backward(ctx, *_):
        raise higher_order_error("torch", ctx.backend)


def first_order_only(backend, grads, inputs):
    """``grads`` (tensors or None) as they are, unless autograd is recording this backward
    (``create_graph=True``) and one of ``inputs`` (the tensors the gradients depend on)
    requires grad: then each is tied to them through a node that raises when differentiated."""
    if not torch.is_grad_enabled():
        return grads
    inputs = [x for x in inputs if torch.is_tensor(x) and x.requires_grad]
    present = [g for g in grads if g is not None]
    if not inputs or not present:
        return grads
    guarded = iter(_FirstOrderOnly.apply(backend, len(present), *present, *inputs))
    return tuple(None if g is None else next(guarded) for g in grads)
