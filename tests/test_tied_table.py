"""A tied table's gradient with the lookups' rows handed to the head (``tied_table``): the same
gradient as ``torch.nn.functional.embedding`` gives, whichever of the relay and the lookups
runs first and in whichever backward passes, with one table-sized buffer.

The models here are exact in float64 (small integers: every sum of their gradients is exact
whatever its order), so the routed gradient must equal autograd's own bit for bit.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


from dlm_kernels.torch.integrations.tied_table import (TableGradTape,  # noqa: E402
                                                       relay_table, tied_lookup)
from dlm_kernels.torch.integrations.tied_table import add_rows_ as tied_table_add_rows  # noqa: E402
from storage_probe import NewStorages  # noqa: E402

V, D, PAD = 37, 6, 3


def _ints(rng, shape, lo=-4, hi=5):
    return torch.from_numpy(rng.integers(lo, hi, shape)).to(torch.float64)


class Toy:
    """A prompt's and a canvas's lookups of a table E [V, D] and a head reading E (the loss
    ``head``: Σ C ⊙ (h · Eᵀ), h from both lookups), plus ``aux``, a loss on the lookups alone.
    Tokens repeat, the padding id and tokens shared by both lookups included."""

    def __init__(self, rng):
        self.table = torch.nn.Parameter(_ints(rng, (V, D)))
        self.prompt = torch.from_numpy(rng.integers(0, V, (2, 9)))
        self.canvas = torch.from_numpy(rng.integers(0, 8, (2, 12)))  # many repeats
        self.prompt[0, :3] = PAD
        self.canvas[1, :2] = PAD
        self.canvas[0, 5] = self.prompt[1, 4]
        self.c = _ints(rng, (2, V))
        self.a = _ints(rng, (2, 9, D))
        self.b = _ints(rng, (2, 12, D))

    def losses(self, routed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(head, aux)."""
        E = self.table
        if routed:
            tape = TableGradTape()
            head_table = relay_table(E, tape)
            x = tied_lookup(self.prompt, E, PAD, tape, head_table)
            y = tied_lookup(self.canvas, E, PAD, tape, head_table)
        else:
            head_table = E
            x = torch.nn.functional.embedding(self.prompt, E, PAD)
            y = torch.nn.functional.embedding(self.canvas, E, PAD)
        h = x.sum(1) + 2 * y.sum(1)  # [2, D]
        head = (self.c.T * (head_table @ h.T)).sum()  # dW: one contiguous [V, D] product
        aux = (self.a * x).sum() + (self.b * y).sum()
        return head, aux


def _grads(toy: Toy, routed: bool, how: str) -> torch.Tensor:
    toy.table.grad = None
    head, aux = toy.losses(routed)
    if how == "head":
        head.backward()
    elif how == "head + aux":
        (head + aux).backward()
    elif how == "aux alone":  # the head's relay never runs: the lookups keep their tables
        aux.backward()
    elif how == "aux, then head":  # two backward passes over one graph
        aux.backward(retain_graph=True)
        head.backward()
    elif how == "head twice":  # a retained graph's second pass starts with an empty tape
        head.backward(retain_graph=True)
        head.backward()
    elif how == "autograd.grad":
        (g,) = torch.autograd.grad(head + aux, toy.table)
        assert toy.table.grad is None
        return g
    else:
        raise AssertionError(how)
    return toy.table.grad


@pytest.mark.parametrize("how", ["head", "head + aux", "aux alone", "aux, then head",
                                 "head twice", "autograd.grad", "relay first"])
def test_the_table_gradient_is_autograd_s_own(rng, how, monkeypatch):
    """The routed gradient equals autograd's (as numbers: where no lookup touches a row,
    autograd's sum turns a -0 of dW into +0 and the route leaves it). "relay first": every
    lookup's backward comes after the relay's (the tape refuses its rows), so each keeps its
    dense gradient."""
    if how == "relay first":
        monkeypatch.setattr(TableGradTape, "give", lambda self, *a: False)
        how = "head + aux"
    toy = Toy(rng)
    want = _grads(toy, False, how).clone()
    got = _grads(toy, True, how)
    assert torch.equal(got, want), (got - want).abs().max()
    if how == "aux alone":  # the lookups alone: the padding row gets nothing
        assert torch.count_nonzero(got[PAD]) == 0 and torch.count_nonzero(got) > 0


def test_rows_go_to_the_relay_and_one_table_is_made(rng, monkeypatch):
    """In one backward of head + aux both lookups hand their rows over and the only
    table-sized buffer made is the head's dW, which becomes ``.grad`` itself."""
    given = []
    give = TableGradTape.give
    monkeypatch.setattr(TableGradTape, "give", lambda self, *a: given.append(a[1].shape[0])
                        or give(self, *a))
    toy = Toy(rng)
    head, aux = toy.losses(True)
    with NewStorages((V, D)) as seen:
        (head + aux).backward()
    assert given == [toy.canvas.numel(), toy.prompt.numel()] or \
        given == [toy.prompt.numel(), toy.canvas.numel()], given
    assert seen.storages == {toy.table.grad.untyped_storage().data_ptr()}, seen.ops
    toy.table.grad = None
    head, aux = toy.losses(False)
    with NewStorages((V, D)) as seen:
        (head + aux).backward()
    assert len(seen.storages) >= 2, seen.ops  # autograd's lookups: tables of their own


def test_a_relay_that_has_run_refuses_rows():
    """A lookup whose backward comes after the relay's in the same pass keeps its gradient
    (the tape refuses it), so no row is lost whatever order autograd takes."""
    tape = TableGradTape()
    ids, rows = torch.tensor([1, 2]), torch.ones(2, D)
    assert tape.give(7, ids, rows)
    assert [i.tolist() for i, _ in tape.take(7)] == [[1, 2]]
    assert not tape.give(7, ids, rows)
    assert tape.take(7) == []
    assert tape.give(8, ids, rows)  # another pass


def test_compiled_autograd_keeps_the_lookups_gradients(rng):
    """Under compiled autograd (the backward traced by Dynamo) the lookups return their dense
    gradients and the relay passes dW through: the same gradient (before, the trace raised
    on the relay's tape)."""
    from torch._dynamo import compiled_autograd

    toy = Toy(rng)
    want = _grads(toy, False, "head + aux").clone()
    toy.table.grad = None
    head, aux = toy.losses(True)
    with compiled_autograd._enable(torch.compile(backend="eager")):
        (head + aux).backward()
    assert torch.equal(toy.table.grad, want), (toy.table.grad - want).abs().max()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_rows_are_summed_in_float32_then_added_once(rng, device):
    """bfloat16: each id's rows are summed in float32 and added to its table row in one
    rounding, so every element lies within half an ulp of the exact sum (one row drawn 1000
    times, another 3 times, the rest once; on a GPU torch's own ``index_put_``). Adding them
    one at a time, each add rounded to bfloat16 (``index_put_`` with accumulate on a CPU),
    strays: row 5 starts at 256 and gets 1000 addends of 0.5 in its first column, each
    256.5 rounding back to 256 (an error of 500 where the sum is 756)."""
    table64 = torch.from_numpy(rng.normal(size=(V, D))) * 4
    ids = torch.from_numpy(rng.integers(0, V, 40))
    ids[ids == 5] = 6
    ids = torch.cat([ids, torch.full((1000,), 5), torch.full((3,), 9)])
    rows64 = torch.from_numpy(rng.normal(size=(ids.numel(), D)))
    table64[5, 0] = 256.0
    rows64[ids == 5, 0] = 0.5
    table, rows = table64.bfloat16().to(device), rows64.bfloat16().to(device)
    ids = ids.to(device)
    exact = table.double().index_add(0, ids, rows.double())
    got = tied_table_add_rows(table.clone(), ids, rows).double()
    # eps·|x| bounds bfloat16's spacing at x; rounding to nearest errs by at most half of
    # it (the float32 sums' own error is below 2^-10 of that)
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(2.0 ** -126)
    assert ((got - exact).abs() <= 0.5 * ulp * (1 + 2.0 ** -10)).all(), \
        ((got - exact).abs() / ulp).max()
    one_at_a_time = table.cpu().index_put_((ids.cpu(),), rows.cpu(), accumulate=True)
    assert one_at_a_time[5, 0] == 256 and exact[5, 0] == 756  # the control strays
