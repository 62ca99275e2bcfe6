"""transformers' DiffusionGemma (``DiffusionGemmaForBlockDiffusion``) under
``apply_dlm_kernels_to_diffusion_gemma``, on a tiny random model built here (2 layers, D 64,
V 1024, 4 experts, canvas 16; no download), its tied table scaled so that the logits reach
the softcap (30).

The reference is the unpatched model: its capped logits fed to the float64 oracle's loss and
gradient (``tests/oracle.py``), backpropagated through transformers' own float32 (or
bfloat16) graph. The float64 truth is the same model in float64 (logits, cap and loss all in
float64). Error model of a parameter's gradient: the patched one lies within the table's
tolerance plus twice the reference's own distance from the truth (that parameter's largest),
i.e. the fused loss's float32 rounding costs no more than transformers' float32 (bfloat16)
training already does. Skipped where transformers (with DiffusionGemma: 5.23) is absent.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.diffusion_gemma")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import (DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion,  # noqa: E402
                          LogitsProcessorList)
from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf_generation  # noqa: E402
from transformers.models.diffusion_gemma import modeling_diffusion_gemma as hf_modeling  # noqa: E402

import dlm_kernels.torch as dk  # noqa: E402
import oracle  # noqa: E402
from dlm_kernels.testing import TOLERANCES  # noqa: E402
from dlm_kernels.torch.integrations import (MODEL_TYPE_TO_APPLY_FN, apply_dlm_kernels,  # noqa: E402
                                            apply_dlm_kernels_to_diffusion_gemma)
from dlm_kernels.torch.integrations import diffusion_gemma as integration  # noqa: E402
from harness import assert_close  # noqa: E402
from storage_probe import NewStorages  # noqa: E402

B, S, L, D, V = 2, 5, 16, 64, 1024  # batch, prompt, canvas, width, vocabulary
CAP = 30.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True)
def unpatched_class(monkeypatch):
    """The reference is transformers' class as it ships, whatever patched the class earlier
    in the process (the README's block patches it); restored after each test."""
    embedding = hf_modeling.DiffusionGemmaTextScaledWordEmbedding
    for cls, names in ((DiffusionGemmaForBlockDiffusion, ("forward", "_denoising_step")),
                       (embedding, ("forward",))):
        for name in names:
            monkeypatch.setattr(cls, name, getattr(cls, integration._ORIGINAL + name,
                                                   getattr(cls, name)))


def tiny_config() -> DiffusionGemmaConfig:
    text = dict(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=32,
                num_experts=4, top_k_experts=2, moe_intermediate_size=32, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=256)
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=16)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=L,
                                  boi_token_id=V - 3, eoi_token_id=V - 2, image_token_id=V - 1)
    # the experts as plain matmuls (the grouped kernel takes no float64 for the truth)
    config._experts_implementation = "eager"
    config.text_config._experts_implementation = "eager"
    return config


def build(rng, dtype: str = "float32") -> DiffusionGemmaForBlockDiffusion:
    """A random tiny model whose tied table is scaled so that |logits| reach the cap."""
    torch.manual_seed(int(rng.integers(2**31)))
    model = DiffusionGemmaForBlockDiffusion(tiny_config())
    with torch.no_grad():
        model.lm_head.weight.mul_(150.0)
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    assert model.final_logit_softcapping == CAP
    return model.to(DTYPES[dtype]).train()


def make_inputs(rng, supervised: float = 0.7) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(model inputs, canvas labels x0 with -100 where unsupervised, encoder labels)."""
    prompt = torch.from_numpy(rng.integers(0, V - 3, (B, S)))
    canvas = torch.from_numpy(rng.integers(0, V, (B, L)))
    labels = torch.from_numpy(rng.integers(0, V, (B, L)))
    labels[torch.from_numpy(rng.uniform(size=(B, L)) > supervised)] = -100
    encoder_labels = prompt.clone()
    encoder_labels[:, :1] = -100
    return dict(input_ids=prompt, decoder_input_ids=canvas), labels, encoder_labels


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def token_ce(z: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None,
             den: float | None = None) -> tuple[float, np.ndarray]:
    """(Σ w·CE / Σ w, d/dz) of the capped logits z [.., V] over the supervised positions."""
    lead = z.shape[:-1]
    z, y = z.reshape(-1, V), labels.reshape(-1)
    active = y != -100
    w = active.astype(np.float64) if weights is None else np.where(active, weights.reshape(-1), 0)
    den = w.sum() if den is None else den
    yy = np.where(active, y, 0)
    _, logp, _, _ = oracle.token_stats(z, yy, active)
    zeros = np.zeros(len(y))
    dz, _ = oracle.token_stats_vjp(z, yy, active, (zeros, -w / den, zeros, zeros))
    return float(-(w * logp).sum() / den), dz.reshape(*lead, V)


def _capped(model, hidden: torch.Tensor, float64: bool) -> torch.Tensor:
    """transformers' head: lm_head, to float32, the cap (the truth: all in float64)."""
    z = model.lm_head(hidden)
    z = z if float64 else z.float()
    return torch.tanh(z / CAP) * CAP


def reference(model, inputs: dict, loss_terms, float64: bool = False):
    """(loss, {name: grad}) of ``model`` unpatched: its capped canvas and encoder logits
    into ``loss_terms(zc, ze) -> (loss, dzc, dze)`` (float64 NumPy), the float64 cotangents
    backpropagated through the model. ``float64``: a float64 copy, logits never float32."""
    if float64:
        model = copy.deepcopy(model).double()
    model.zero_grad(set_to_none=True)
    if float64:
        out = model.model(**inputs)
        zc = _capped(model, out.last_hidden_state, True)
    else:
        out = model(**inputs)  # transformers' own forward and capped logits
        zc = out.logits
    ze = _capped(model, out.encoder_last_hidden_state, float64)
    loss, dzc, dze = loss_terms(_np(zc), _np(ze))
    pairs = [(z, torch.from_numpy(g).to(z.dtype)) for z, g in ((zc, dzc), (ze, dze))
             if g is not None]
    torch.autograd.backward([z for z, _ in pairs], [g for _, g in pairs])
    return loss, {n: p.grad for n, p in model.named_parameters()}


def check_gradients(patched, ref_grads: dict, truth_grads: dict, dtype: str) -> None:
    """Every parameter's gradient: within the table plus twice the reference's own largest
    distance from the truth (module docstring); gradients exist where the reference's do."""
    seen = 0
    for name, p in patched.named_parameters():
        ref, truth = ref_grads[name], truth_grads[name]
        assert (p.grad is None) == (ref is None), (name, p.grad is None, ref is None)
        if ref is None:
            continue
        slack = 2.0 * float(np.abs(_np(ref) - _np(truth)).max())
        assert_close(_np(p.grad), _np(truth), dtype, name=f"d {name}", slack=slack)
        seen += 1
    assert seen > 40, seen  # the text stack's every parameter (the vision tower gets none)


def run_patched(model, inputs: dict, **loss_args):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, **loss_args)
    out.loss.backward()
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loss_and_every_gradient_match_the_float64_reference(rng, dtype):
    """The token-mean CE over the supervised canvas positions from the hidden states and the
    tied head, logits None in training; loss within the float32 table of the oracle's on
    transformers' own capped logits, every parameter's gradient within the error model."""
    model = build(rng, dtype)
    ref = copy.deepcopy(model)
    inputs, labels, _ = make_inputs(rng)
    terms = lambda zc, ze: (*token_ce(zc, labels.numpy()), None)
    want, ref_grads = reference(ref, inputs, terms)
    _, truth_grads = reference(ref, inputs, terms, float64=True)
    apply_dlm_kernels_to_diffusion_gemma(model)
    out = run_patched(model, inputs, labels=labels)
    assert out.logits is None
    zc = _np(ref(**inputs).logits)
    assert np.abs(zc).max() > 0.9 * CAP, np.abs(zc).max()  # the cap is exercised
    assert out.loss.dtype == torch.float32 and out.loss.shape == ()
    assert_close(_np(out.loss), want, "float32", name="loss")
    check_gradients(model, ref_grads, truth_grads, dtype)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an operation returns."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


def test_logits_are_never_formed_in_training(rng, monkeypatch):
    """With token chunks of 3 rows, no operation of the patched forward and backward returns
    a tensor of the logits' size ([B, L, V] or [B·L, V]); transformers' forward does (the
    detector sees it). (The detector reads shapes only: at chunks of 5 rows the chunked
    backend's two [5, V] row tiles, one [2, 5, V] scratch buffer, had the shape of the
    encoder's [B, S - 1, V] logits.)"""
    monkeypatch.setattr(integration, "HEAD_ROW_CHUNK", 3)
    model = build(rng)
    ref = copy.deepcopy(model)
    inputs, labels, encoder_labels = make_inputs(rng)
    whole = {(B, L, V), (B * L, V), (B, S, V), (B * (S - 1), V), (B, S - 1, V)}
    with _Shapes() as seen:
        ref(**inputs).logits.sum().backward()
    assert (B, L, V) in seen.shapes
    apply_dlm_kernels_to_diffusion_gemma(model)
    with _Shapes() as seen:
        out = run_patched(model, inputs, labels=labels, encoder_labels=encoder_labels)
    assert out.logits is None
    assert not (seen.shapes & whole), sorted(seen.shapes & whole)
    assert (3, V) in seen.shapes  # the head's chunks


def test_eval_and_the_tuple_form(rng):
    """Outside training (or skip_logits=False) the logits are transformers' own, bit for bit,
    beside the loss; return_dict=False gives the tuple (loss first); without labels nothing
    changes; skip_logits=True without labels is an error."""
    model = build(rng)
    ref = copy.deepcopy(model).eval()
    apply_dlm_kernels_to_diffusion_gemma(model)
    model.eval()
    inputs, labels, _ = make_inputs(rng)
    with torch.no_grad():
        want = ref(**inputs)
        states = ref(**inputs, output_hidden_states=True, output_attentions=True)
        passed = model(**inputs, labels=labels, output_hidden_states=True,
                       output_attentions=True)
        plain = model(**inputs)
        both = model(**inputs, labels=labels)
        tup = model(**inputs, labels=labels, return_dict=False)
        kept = model.train()(**inputs, labels=labels, skip_logits=False)
    for out in (plain, both, kept):
        assert torch.equal(out.logits, want.logits)
        assert torch.equal(out.encoder_last_hidden_state, want.encoder_last_hidden_state)
    assert plain.loss is None and both.loss is not None
    # what the model returns beside the logits passes through (router outputs too, where
    # transformers records them; 5.23 returns none at this level)
    assert set(passed.keys()) == set(states.keys()) | {"loss"}, (passed.keys(), states.keys())
    for key in ("hidden_states", "attentions"):
        assert all(torch.equal(a, b) for a, b in zip(passed[key], states[key])), key
    assert torch.equal(kept.loss, both.loss)
    assert isinstance(tup, tuple) and len(tup) == 4
    assert torch.equal(tup[0], both.loss) and torch.equal(tup[1], want.logits)
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        model(**inputs, skip_logits=True)


def test_num_items_in_batch_and_nothing_supervised(rng):
    """num_items_in_batch replaces the count of supervised positions (Σ CE / n); loss_mask
    without a variant weights the token mean (Σ w·CE / Σ w); a batch with no supervised
    position has loss 0 and zero gradients; a NaN or negative num_items_in_batch gives NaN;
    a denominator or weights far from 1 give Σ w·CE / den."""
    model = build(rng)
    apply_dlm_kernels_to_diffusion_gemma(model)
    inputs, labels, encoder_labels = make_inputs(rng)
    count = int((labels != -100).sum())
    mean = run_patched(model, inputs, labels=labels).loss
    summed = run_patched(model, inputs, labels=labels,
                         num_items_in_batch=torch.tensor(3 * count)).loss
    assert_close(_np(summed) * 3, _np(mean), "float32", name="loss with num_items_in_batch")
    weights = torch.from_numpy(rng.uniform(0.5, 2.0, (B, L))).float()
    weighted = run_patched(model, inputs, labels=labels, loss_mask=weights).loss
    model.zero_grad(set_to_none=True)
    zc = model.eval()(**inputs).logits
    model.train()
    want, _ = token_ce(_np(zc), labels.numpy(), weights.double().numpy())
    assert_close(_np(weighted), want, "float32", name="loss with loss_mask as weights")
    out = run_patched(model, inputs, labels=torch.full_like(labels, -100))
    assert out.loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    # a NaN or negative denominator: the loss and every gradient NaN (WeightedSum's
    # contract), with the encoder's term beside it too; never an error about weights the
    # caller did not pass
    for den in (float("nan"), -5.0):
        out = run_patched(model, inputs, labels=labels, encoder_labels=encoder_labels,
                          num_items_in_batch=torch.tensor(den))
        assert torch.isnan(out.loss), (den, out.loss)
        assert all(torch.isnan(p.grad).all() for p in model.parameters()
                   if p.grad is not None), den
    # denominators far from the weights' scale: Σ w·CE / den as it is, no error about weights
    one = torch.full_like(labels, -100)
    one[0, 0] = 5
    ce_one = run_patched(model, inputs, labels=one).loss
    huge = run_patched(model, inputs, labels=one, num_items_in_batch=torch.tensor(3e38)).loss
    assert_close(_np(huge) * 3e38, _np(ce_one), "float32", name="one token over 3e38")
    tiny_w = torch.full(labels.shape, 1e-30)
    small = run_patched(model, inputs, labels=labels, loss_mask=tiny_w,
                        num_items_in_batch=torch.tensor(1e10)).loss
    assert_close(_np(small) * 1e40, _np(mean) * count, "float32",
                 name="weights 1e-30 over 1e10")


@pytest.mark.parametrize("variant, encoder", [(v, False) for v in dk.VARIANTS]
                         + [(dk.VARIANTS[0], True)])
def test_sft_variants(rng, variant, encoder):
    """variant / diffusion_t / loss_mask: the batch mean of Megatron-Bridge's SFT loss
    (``diffusion_sft_loss``: x0 = labels, xt = decoder_input_ids) on the capped logits, against
    the oracle's, and every parameter's gradient; with encoder_labels too (the SFT loss and
    the encoder's token mean then read the head in two passes, their dWs summed before the
    tied table's lookups add their rows)."""
    model = build(rng)
    ref = copy.deepcopy(model)
    inputs, labels, encoder_labels = make_inputs(rng)
    t = rng.uniform(0.05, 0.95, B)
    mask = (rng.uniform(size=(B, L)) < 0.8) * (labels.numpy() != -100) * 1.0
    x0, xt = np.where(labels.numpy() != -100, labels.numpy(), 0), inputs["decoder_input_ids"].numpy()

    def terms(zc, ze):
        loss = oracle.sft_loss(zc, x0, xt, t, mask, variant, V).mean()
        dz = oracle.sft_loss_grad(zc, x0, xt, t, mask, variant, V, np.full(B, 1.0 / B))
        if not encoder:
            return loss, dz, None
        enc, dze_head = token_ce(ze[:, :-1], encoder_labels.numpy()[:, 1:])
        dze = np.zeros_like(ze)
        dze[:, :-1] = dze_head
        return loss + enc, dz, dze

    want, ref_grads = reference(ref, inputs, terms)
    _, truth_grads = reference(ref, inputs, terms, float64=True)
    apply_dlm_kernels_to_diffusion_gemma(model)
    extra = dict(encoder_labels=encoder_labels) if encoder else {}
    out = run_patched(model, inputs, labels=labels, variant=variant,
                      diffusion_t=torch.from_numpy(t).float(),
                      loss_mask=torch.from_numpy(mask).float(), **extra)
    assert out.logits is None
    assert_close(_np(out.loss), want, "float32", name=f"{variant} loss")
    check_gradients(model, ref_grads, truth_grads, "float32")


def _repeats_and_padding(rng, inputs: dict) -> None:
    """Tokens as a diffusion batch has them: the canvas a few ids, each many times (as a mask
    token is), the padding id (0, the table's ``padding_idx``) in the prompt and the canvas,
    and ids the prompt and the canvas share."""
    prompt, canvas = inputs["input_ids"], inputs["decoder_input_ids"]
    canvas.copy_(torch.from_numpy(rng.integers(1, 4, canvas.shape)))
    prompt[:, :2] = 0
    canvas[:, -3:] = 0
    prompt[:, 3] = canvas[:, 0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", ["random", "repeats and padding"])
def test_encoder_labels(rng, tokens, dtype):
    """encoder_labels adds the encoder's next-token CE (position s predicts label s + 1)
    through the same capped tied head to the canvas loss; every gradient as above. The tied
    table's gradient is formed once: the only buffer of the table's shape and dtype that the
    forward and backward make is the head's dW, which becomes the table's ``.grad`` (the
    lookups hand their rows to it, ``tied_table``; both terms are read in one pass over the
    head). (At this size a bfloat16 head sums dW in float32 before rounding it: README,
    "Two gradient schedules".)"""
    model = build(rng, dtype)
    ref = copy.deepcopy(model)
    inputs, labels, encoder_labels = make_inputs(rng)
    if tokens != "random":
        _repeats_and_padding(rng, inputs)

    def terms(zc, ze):
        canvas, dzc = token_ce(zc, labels.numpy())
        enc, dze_head = token_ce(ze[:, :-1], encoder_labels.numpy()[:, 1:])
        dze = np.zeros_like(ze)
        dze[:, :-1] = dze_head
        return canvas + enc, dzc, dze

    want, ref_grads = reference(ref, inputs, terms)
    _, truth_grads = reference(ref, inputs, terms, float64=True)
    apply_dlm_kernels_to_diffusion_gemma(model)
    model.zero_grad(set_to_none=True)
    table = model.lm_head.weight
    with NewStorages(tuple(table.shape), table.dtype) as tables:
        out = model(**inputs, labels=labels, encoder_labels=encoder_labels)
        out.loss.backward()
    assert tables.storages == {model.lm_head.weight.grad.untyped_storage().data_ptr()}, \
        tables.ops
    assert_close(_np(out.loss), want, "float32", name="canvas + encoder loss")
    check_gradients(model, ref_grads, truth_grads, dtype)


def test_a_lookup_with_max_norm_keeps_autograd_s_gradient(rng, monkeypatch):
    """A tied lookup with max_norm renormalises the table's rows in place during the forward:
    then no lookup hands its rows to the head (a view of the table made before it would be
    invalidated; before, the forward raised), and the gradients are those of the patched
    model without the route, bit for bit."""
    model = build(rng)
    apply_dlm_kernels_to_diffusion_gemma(model)
    assert len(integration._tied_lookups(model, True)) == 2  # plain lookups: routed
    model.model.decoder.embed_tokens.max_norm = 1e9  # renormalises nothing, but runs in place
    assert integration._tied_lookups(model, True) == []
    inputs, labels, encoder_labels = make_inputs(rng)
    grads = []
    for route in (True, False):
        if not route:
            monkeypatch.setattr(integration, "_tied_lookups", lambda self, wants_loss: [])
        run_patched(model, inputs, labels=labels, encoder_labels=encoder_labels)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_class_patch_and_registry(rng, monkeypatch):
    """model=None patches the class (models built afterwards compute the loss);
    apply_dlm_kernels finds the patch by config.model_type; bad arguments name themselves."""
    assert MODEL_TYPE_TO_APPLY_FN["diffusion_gemma"] is apply_dlm_kernels_to_diffusion_gemma
    apply_dlm_kernels(model_type="diffusion_gemma")
    model = build(rng)
    inputs, labels, _ = make_inputs(rng)
    assert model(**inputs, labels=labels).logits is None
    apply_dlm_kernels(model)  # an instance, by its config.model_type
    with pytest.raises(ValueError, match=r"no dlm-kernels patch for model_type 'llama'"):
        apply_dlm_kernels(model_type="llama")
    with pytest.raises(TypeError, match=r"model must be a DiffusionGemmaForBlockDiffusion"):
        apply_dlm_kernels_to_diffusion_gemma(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="fused_self_conditioning=True .* needs fused_sampling"):
        apply_dlm_kernels_to_diffusion_gemma(model, fused_sampling=False,
                                             fused_self_conditioning=True)
    with pytest.raises(TypeError, match=r"fused_sampling must be True or False; got 1"):
        apply_dlm_kernels_to_diffusion_gemma(model, fused_sampling=1)
    with pytest.raises(ValueError, match=r"labels must have shape \[2, 16\]"):
        model(**inputs, labels=labels[:, :-1])
    with pytest.raises(ValueError, match="needs diffusion_t"):
        model(**inputs, labels=labels, variant="loo-ce")
    with pytest.raises(ValueError, match="they need labels"):
        model(**inputs, diffusion_t=0.5)


# -- generation ----------------------------------------------------------------------------

def _entropy_bound_acceptance(monkeypatch, entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """transformers' EntropyBoundSampler.accept_canvas's mask for these entropies: its own
    sort, running sum and comparison, its Categorical handing it the entropies given."""

    class Given:
        def __init__(self, logits):
            pass

        def entropy(self):
            return entropy

    sampler = hf_generation.EntropyBoundSampler(
        hf_generation.EntropyBoundSamplerConfig(entropy_bound=bound), entropy.shape[1], V, 1)
    with monkeypatch.context() as m:
        m.setattr(torch.distributions, "Categorical", Given)
        canvas = torch.zeros(entropy.shape, dtype=torch.long)
        sampler.accept_canvas(canvas, canvas + 1, torch.zeros(*entropy.shape, 2), 0)
    return sampler.accepted_token_mask


def test_exclusive_budget_is_the_entropy_bound_sampler(rng, monkeypatch):
    """commit_tokens(rule="entropy_budget", exclusive=True) over every position accepts what
    transformers' EntropyBoundSampler accepts for the same entropies, bit for bit, with bounds
    that sit exactly on a running sum (the default rule accepts one fewer there)."""
    n, l = 64, L
    entropy = torch.from_numpy(rng.exponential(0.05, (n, l))).float()
    sorted_e = torch.sort(entropy, dim=-1).values
    on_sum = (torch.cumsum(sorted_e, -1) - sorted_e)[:, 3]  # the fourth's exclusive sum
    canvas = torch.zeros(n, l, dtype=torch.long)
    zeros = torch.zeros(n, l)
    sample = dk.Sample(canvas + 1, zeros, canvas, zeros, zeros, entropy, vocab_size=V)
    everywhere = torch.ones(n, l, dtype=torch.bool)
    for bound in (0.1, 0.01, 1.0):
        got = dk.commit_tokens(canvas, sample, everywhere, rule="entropy_budget",
                               budget=bound, exclusive=True)[1]
        assert torch.equal(got, _entropy_bound_acceptance(monkeypatch, entropy, bound)), bound
    for row in range(4):  # per-row bounds on a running sum: exactly 4 accepted
        bound = float(on_sum[row])
        want = _entropy_bound_acceptance(monkeypatch, entropy[row:row + 1], bound)
        got = dk.commit_tokens(canvas[:1], sample._replace(
            **{f: getattr(sample, f)[row:row + 1] for f in sample._fields}), everywhere[:1],
            rule="entropy_budget", budget=bound, exclusive=True)[1]
        assert torch.equal(got, want) and int(got.sum()) >= 4, (row, got, want)


def _step_inputs(model, rng):
    """One denoising step's inputs after the prompt's encoding, as generate builds them."""
    prompt = torch.from_numpy(rng.integers(0, V - 3, (B, S)))
    enc = model.model.encoder(input_ids=prompt)
    canvas = torch.from_numpy(rng.integers(0, V, (B, L)))
    return dict(
        decoder_forward=model.forward, current_canvas=canvas, argmax_canvas=canvas,
        input_ids=prompt, decoder_position_ids=torch.arange(S, S + L)[None],
        self_conditioning_logits=None, mask_mapping=None,
        past_key_values=enc.past_key_values, finished_denoising=torch.zeros(B, dtype=torch.bool),
        cur_step=3, logits_processor=lambda ids, scores, cur_step: scores / 0.05,
        diffusion_stopping_criteria=None)


def test_fused_denoising_step(rng):
    """The patched step keeps transformers' argmax canvas and self-conditioning logits bit for
    bit and its acceptance; accepted positions hold the fused draw, the others transformers'
    renoising; generate runs, and torch.manual_seed repeats it."""
    model = build(rng).eval()
    ref = copy.deepcopy(model)
    apply_dlm_kernels_to_diffusion_gemma(model)

    def sampler():
        return hf_generation.EntropyBoundSampler(
            hf_generation.EntropyBoundSamplerConfig(entropy_bound=0.5), L, V, 4)

    with torch.no_grad():
        inputs = _step_inputs(ref, rng)
        ours_sampler, ref_sampler = sampler(), sampler()
        want = ref._denoising_step(sampler=ref_sampler, **inputs)
        got = model._denoising_step(sampler=ours_sampler, **{**inputs,
                                                            "decoder_forward": model.forward})
    assert torch.equal(got[1], want[1])  # argmax canvas
    assert torch.equal(got[2], want[2])  # self-conditioning logits
    accepted = ours_sampler.accepted_token_mask
    assert torch.equal(accepted, ref_sampler.accepted_token_mask)
    assert (accepted.sum(1) >= 1).all() and (~accepted).any()
    # accepted positions hold drawn tokens: valid ids, likely under the processed logits
    logp = torch.log_softmax(want[2].float(), -1).gather(
        -1, got[0].clamp(0, V - 1)[..., None])[..., 0]
    assert ((got[0] >= 0) & (got[0] < V)).all()
    assert (logp[accepted] > -20).all(), logp[accepted]
    prompt = torch.from_numpy(rng.integers(0, V - 3, (1, S)))
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        with torch.no_grad():
            runs.append(model.generate(prompt, max_new_tokens=L, max_denoising_steps=3))
    seq = runs[0] if isinstance(runs[0], torch.Tensor) else runs[0].sequences
    seq2 = runs[1] if isinstance(runs[1], torch.Tensor) else runs[1].sequences
    assert seq.shape[1] >= S + 1 and torch.equal(seq, seq2)
    assert ((seq >= 0) & (seq < V)).all()


def test_fused_step_from_the_head_forms_no_logits(rng, monkeypatch):
    """With fused self-conditioning, no adaptive stopping and transformers' temperature
    schedule as the only logits processor, the step reads the decoder's hidden states through
    the capped tied head: no operation returns a [B, L, V] tensor (transformers' step does);
    the argmax canvas and the accepted positions are transformers' (the entropies are those
    of cap(h·W) / T in float32, as its Categorical's to float32 rounding); the signal carried
    is softmax(cap(h·W) / T)·E·sqrt(D) against the float64 formula on transformers' logits."""
    monkeypatch.setattr(integration, "HEAD_ROW_CHUNK", 3)
    monkeypatch.setattr(integration, "SIGNAL_CHUNK", 256)  # the signal's vocabulary chunks
    model = build(rng).eval()
    ref = copy.deepcopy(model)
    apply_dlm_kernels_to_diffusion_gemma(model, fused_self_conditioning=True)
    schedule = hf_generation.LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, 48)
    processors = LogitsProcessorList([schedule])

    def sampler():
        return hf_generation.EntropyBoundSampler(
            hf_generation.EntropyBoundSamplerConfig(entropy_bound=0.5), L, V, 4)

    with torch.no_grad():
        inputs = dict(_step_inputs(ref, rng), logits_processor=processors, cur_step=20)
        ref_sampler, ours_sampler = sampler(), sampler()
        want = ref._denoising_step(sampler=ref_sampler, **inputs)
        with _Shapes() as seen:
            got = model._denoising_step(sampler=ours_sampler,
                                        **{**inputs, "decoder_forward": model.forward})
    assert not (seen.shapes & {(B, L, V), (B * L, V)}), sorted(seen.shapes)
    assert (3, V) in seen.shapes and (B * L, 256) in seen.shapes  # the head's chunks
    assert torch.equal(got[1], want[1])  # argmax canvas
    assert torch.equal(ours_sampler.accepted_token_mask, ref_sampler.accepted_token_mask)
    assert got[2].shape == (B, L, D)
    p = torch.softmax(want[2].double(), -1).numpy()  # transformers' processed logits, at T
    table = _np(model.model.decoder.embed_tokens.weight)
    scale = float(model.model.decoder.embed_tokens.embed_scale)
    # our float32 logits (token chunks, the kernels' cap) and transformers' differ by a few
    # roundings of |cap(z) / T| <= 30 / T (4 ulps here), which move each p relatively by
    # twice that: against Σ p·|E|, which cancels in the signal (worst measured: 0.1 of this)
    t = 0.4 + 0.4 * 20 / 48
    bound = (2.0 ** -21 * (CAP / t) * (p @ np.abs(table)) * scale
             + TOLERANCES["float32"][0] * float(np.abs(table).max()) * scale)
    err = np.abs(_np(got[2]) - p @ table * scale)
    assert (err <= bound).all(), (err.max(), np.unravel_index(np.argmax(err / bound), err.shape))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_self_conditioning(rng, dtype):
    """fused_self_conditioning=True: the step carries [B, L, D] soft embeddings, not [B, L, V]
    logits; the signal the decoder's self-conditioning block reads at the next step is
    transformers' own (captured at its block) within the roundings transformers adds: it
    rounds each probability and the matmul's result to the table's dtype, we round the
    float32 sum once (bfloat16: |ours - theirs| <= 2^-8·Σ p·|E|·sqrt(D) + 2^-8·|theirs|;
    float32: the float32 table's tolerance, as both sum in float32). The first step's argmax
    canvas is equal; the second step's too in float32. generate runs and repeats under
    torch.manual_seed."""
    model = build(rng, dtype).eval()
    ref = copy.deepcopy(model)
    apply_dlm_kernels_to_diffusion_gemma(model, fused_self_conditioning=True)
    dt = DTYPES[dtype]

    def sampler():
        return hf_generation.EntropyBoundSampler(
            hf_generation.EntropyBoundSamplerConfig(entropy_bound=0.5), L, V, 4)

    signals = {}

    def capture(name):
        def hook(module, args):
            signals[name] = args[0].detach().clone()
        return hook

    hooks = [m.model.decoder.self_conditioning.pre_norm.register_forward_pre_hook(capture(n))
             for n, m in (("ref", ref), ("ours", model))]
    with torch.no_grad():
        inputs = _step_inputs(ref, rng)
        want = ref._denoising_step(sampler=sampler(), **inputs)
        got = model._denoising_step(sampler=sampler(), **{**inputs,
                                                         "decoder_forward": model.forward})
        assert torch.equal(got[1], want[1])
        assert got[2].shape == (B, L, D) and got[2].dtype == dt and want[2].shape == (B, L, V)
        step2 = dict(inputs, current_canvas=want[0], argmax_canvas=want[1], cur_step=2)
        want2 = ref._denoising_step(sampler=sampler(), **{**step2,
                                                         "self_conditioning_logits": want[2]})
        got2 = model._denoising_step(sampler=sampler(), **{
            **step2, "decoder_forward": model.forward, "self_conditioning_logits": got[2]})
        # logits handed in (as generate's self_conditioning_logits) become the same signal
        from_logits = model._denoising_step(sampler=sampler(), **{
            **step2, "decoder_forward": model.forward, "self_conditioning_logits": want[2]})
        assert torch.equal(from_logits[1], got2[1]) and torch.equal(from_logits[2], got2[2])
    for h in hooks:
        h.remove()
    theirs, ours = _np(signals["ref"]), _np(signals["ours"])
    table = _np(model.model.decoder.embed_tokens.weight)
    scale = float(model.model.decoder.embed_tokens.embed_scale.to(dt))
    p = torch.softmax(want[2].double(), -1).numpy()
    if dtype == "bfloat16":
        bound = 2.0 ** -8 * (p @ np.abs(table)) * scale + 2.0 ** -8 * np.abs(theirs)
        err = np.abs(ours - theirs)
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert (err <= bound).all(), (err.max(), worst)
        assert (err > 0).any()  # the roundings differ: the bound is what is tested
    else:
        assert_close(ours, theirs, "float32", name="signal",
                     scale=float(np.abs(table).max()) * scale)
        assert torch.equal(got2[1], want2[1])
    # against the float64 formula on transformers' carried logits: no farther than theirs
    exact = p @ table * scale
    assert (np.abs(ours - exact).max()
            <= np.abs(theirs - exact).max() + 2.0 ** -8 * np.abs(exact).max())
    prompt = torch.from_numpy(rng.integers(0, V - 3, (1, S)))
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=L, max_denoising_steps=3)
        runs.append(out if isinstance(out, torch.Tensor) else out.sequences)
    assert torch.equal(runs[0], runs[1]) and ((runs[0] >= 0) & (runs[0] < V)).all()


def _recording_steps(model) -> list:
    """Records every denoising step's outputs (renoised canvas, argmax canvas, carried
    self-conditioning input) of ``model.generate``, through an instance attribute over the
    (patched) step."""
    steps = []
    step = model._denoising_step

    def recorded(**kwargs):
        out = step(**kwargs)
        steps.append(tuple(t.detach().clone() for t in out[:3]))
        return out

    model._denoising_step = recorded
    return steps


def _generated(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.sequences


@pytest.mark.parametrize("fused_sc", [True, False], ids=["signal-from-the-head", "logits"])
def test_generate_under_the_compiled_decoder(rng, monkeypatch, fused_sc):
    """A static cache makes ``generate`` compile the decoder (``torch.compile(self.forward,
    mode="reduce-overhead", fullgraph=True)``, and the sampler's functions): the patched
    forward and decoder trace whole under it, and every denoising step (renoised canvas,
    argmax canvas, carried signal or logits) and the tokens equal the eager patched run's
    (``disable_compile=True``, the same seed) bit for bit. The compile is generate's own call
    (fullgraph) on ``aot_eager`` (AOTAutograd's graph on ATen's eager kernels: eager's bits;
    Inductor's code generation is not what is tested); a second generate, on the compiled
    functions generate keeps on the model, repeats the tokens. Fused self-conditioning without
    adaptive stopping: the signal enters the compiled decoder as an argument and the step
    reads the final hidden states the compiled forward returns; the plain patch, with
    transformers' adaptive stopping: the forward's logits. The experts run as grouped matmuls
    (transformers' eager experts loop over the experts hit, a data-dependent loop that
    fullgraph rejects in transformers' own model)."""
    torch._dynamo.reset()
    config = tiny_config()
    config._experts_implementation = config.text_config._experts_implementation = "grouped_mm"
    torch.manual_seed(int(rng.integers(2**31)))
    model = DiffusionGemmaForBlockDiffusion(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(150.0)
    model.eval()
    compiled_model = copy.deepcopy(model)
    calls = []
    real_compile = torch.compile

    def compile_on_aot_eager(fn, **options):
        calls.append(options)
        assert options.get("fullgraph") is True, options
        options.pop("mode", None)
        return real_compile(fn, backend="aot_eager", **options)

    monkeypatch.setattr(torch, "compile", compile_on_aot_eager)
    prompt = torch.from_numpy(rng.integers(0, V - 3, (B, S)))
    options = dict(max_new_tokens=L, max_denoising_steps=3, cache_implementation="static")
    if fused_sc:  # no adaptive stopping: the head path
        options.update(stability_threshold=None, confidence_threshold=None)
    runs = []
    for m, disable in ((model, True), (compiled_model, False)):
        apply_dlm_kernels_to_diffusion_gemma(m, fused_self_conditioning=fused_sc)
        steps = _recording_steps(m)
        torch.manual_seed(7)
        with torch.no_grad():
            runs.append((_generated(m.generate(prompt, disable_compile=disable, **options)),
                         steps))
        assert hasattr(m, "_compiled_decoder_forward") == (not disable)
    (eager, eager_steps), (compiled, compiled_steps) = runs
    assert calls and len(eager_steps) == len(compiled_steps) >= 2
    for i, (want, got) in enumerate(zip(eager_steps, compiled_steps)):
        for name, a, b in zip(("canvas", "argmax", "carry"), want, got):
            assert a.shape == b.shape and torch.equal(a, b), (i, name)
    assert compiled_steps[-1][2].shape == ((B, L, D) if fused_sc else (B, L, V))
    assert torch.equal(eager, compiled)
    # again: generate keeps its compiled functions on the model, the sampler's bound to the
    # first call's sampler, and the same seed repeats the tokens
    torch.manual_seed(7)
    with torch.no_grad():
        again = _generated(compiled_model.generate(prompt, **options))
    assert torch.equal(again, compiled)
    torch._dynamo.reset()


def test_fused_self_conditioning_over_transformers_forward(rng):
    """fused_linear_loss=False keeps transformers' forward, which returns no hidden states:
    fused self-conditioning without adaptive stopping then reads its logits (the signal from
    them, [B, L, D]); the first step's argmax canvas is the head path's."""
    model = build(rng).eval()
    head = copy.deepcopy(model)
    apply_dlm_kernels_to_diffusion_gemma(model, fused_linear_loss=False,
                                         fused_self_conditioning=True)
    apply_dlm_kernels_to_diffusion_gemma(head, fused_self_conditioning=True)
    prompt = torch.from_numpy(rng.integers(0, V - 3, (B, S)))
    options = dict(max_new_tokens=L, max_denoising_steps=3, stability_threshold=None,
                   confidence_threshold=None)
    runs = []
    for m in (model, head):
        steps = _recording_steps(m)
        torch.manual_seed(7)
        with torch.no_grad():
            runs.append((_generated(m.generate(prompt, **options)), steps))
    (seq, steps), (_, head_steps) = runs
    assert ((seq >= 0) & (seq < V)).all() and seq.shape[1] == S + L
    assert all(carry.shape == (B, L, D) for _, _, carry in steps)
    assert torch.equal(steps[0][1], head_steps[0][1])
