"""Models: presets sized as named, logits equal to Hugging Face Llama, stage split exact, MoE routing and aux loss."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bubblefree.errors import UserError
from bubblefree.models import (
    PRESETS,
    ModelArgs,
    Transformer,
    build_model,
    param_stages,
    split_model,
    stage_layer_ranges,
    to_hf_llama,
)
from bubblefree.models.moe import MoE, load_balancing_loss

VOCAB = 97


def small_args(*, moe: bool = False, tie: bool = False, n_layers: int = 4) -> ModelArgs:
    extra = dict(n_experts=4, top_k=2, n_shared_experts=1, expert_hidden=40, n_dense_layers=1) if moe else {}
    return ModelArgs(vocab_size=VOCAB, dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, mlp_hidden=96,
                     rope_theta=1e4, tie_embeddings=tie, max_seq_len=64, **extra)


def perturbed(args: ModelArgs, seed: int = 0) -> Transformer:
    """A model whose weights are far from init (random norm gains too), so every term of the forward matters."""
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.15 * torch.randn_like(p))
    return model


def tokens(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_count_matches_its_name(name: str) -> None:
    model = build_model(name, device="meta")
    assert model.embed.weight.device.type == "meta"
    number, unit = re.fullmatch(r".*-(\d+(?:\.\d+)?)([mb])", name).groups()
    expected = float(number) * {"m": 1e6, "b": 1e9}[unit]
    total = model.num_params()
    assert abs(total - expected) <= 0.1 * expected, (name, total)
    active = model.num_params(active=True)
    assert (active < total) == (model.args.n_experts > 0)


def test_smollm2_shapes_follow_design() -> None:
    for name, (layers, dim, heads, kv, mlp) in {"smollm2-135m": (30, 576, 9, 3, 1536),
                                                 "smollm2-360m": (32, 960, 15, 5, 2560)}.items():
        a = PRESETS[name]()
        assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.mlp_hidden) == (layers, dim, heads, kv, mlp)
        assert (a.vocab_size, a.tie_embeddings, a.rope_theta) == (49152, True, 1e5)


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(UserError, match="llama-5m.*smollm2-135m"):
        build_model("llama-7b")


def test_build_model_takes_vocab_size() -> None:
    assert build_model("llama-1m", vocab_size=300, device="meta").embed.weight.shape == (300, 48)


# ---------------------------------------------------------------- the dense model against Hugging Face


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_hf_llama(tie: bool) -> None:
    model = perturbed(small_args(tie=tie))
    assert (model.lm_head.weight is model.embed.weight) == tie
    hf = to_hf_llama(model).eval()
    x = tokens(batch=3, seq=33)
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert ours.dtype == torch.float32 and ours.shape == (3, 34, VOCAB)
    assert ours.abs().max() > 1.0  # the comparison is not between near-zero logits
    # float32 through 4 layers: agreement to ~1e-5 relative to the logit scale.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))


def test_init_is_seeded_and_meta_materialises_identically() -> None:
    for args in (small_args(tie=True), small_args(moe=True)):
        torch.manual_seed(3)
        direct = Transformer(args)
        with torch.device("meta"):
            lazy = Transformer(args)
        lazy.to_empty(device="cpu")
        torch.manual_seed(3)
        lazy.init_weights()
        assert (lazy.lm_head.weight is lazy.embed.weight) == args.tie_embeddings
        for (name, a), (_, b) in zip(direct.state_dict().items(), lazy.state_dict().items(), strict=True):
            assert torch.equal(a, b), name


def test_init_scales_residual_projections() -> None:
    torch.manual_seed(0)
    model = build_model("llama-20m")
    residual = 0.02 / math.sqrt(2 * model.args.n_layers)
    assert float(model.layers[0].attn.wq.weight.detach().std()) == pytest.approx(0.02, rel=0.02)
    assert float(model.layers[0].attn.wo.weight.detach().std()) == pytest.approx(residual, rel=0.02)
    assert float(model.layers[0].mlp.w2.weight.detach().std()) == pytest.approx(residual, rel=0.02)
    assert torch.equal(model.norm.weight, torch.ones(model.args.dim))


def test_bad_model_args() -> None:
    with pytest.raises(ValueError, match="Invalid n_kv_heads: 3"):
        ModelArgs(vocab_size=10, dim=64, n_layers=1, n_heads=4, n_kv_heads=3, mlp_hidden=8)
    with pytest.raises(ValueError, match="Invalid top_k: 5"):
        ModelArgs(vocab_size=10, dim=64, n_layers=1, n_heads=4, n_kv_heads=4, mlp_hidden=8, n_experts=4, top_k=5)
    with pytest.raises(ValueError, match="Invalid sequence length: 65"):
        Transformer(small_args())(torch.zeros(1, 65, dtype=torch.long))


# ---------------------------------------------------------------- pipeline split


def test_stage_layer_ranges_hand_examples() -> None:
    assert stage_layer_ranges(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]  # no middle stage: the first takes it
    assert stage_layer_ranges(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]  # middle, then first
    assert stage_layer_ranges(30, 4) == [range(0, 7), range(7, 15), range(15, 23), range(23, 30)]
    for n_layers in range(1, 13):
        for n_stages in range(1, n_layers + 1):
            ranges = stage_layer_ranges(n_layers, n_stages)
            assert [i for r in ranges for i in r] == list(range(n_layers))
            assert len(ranges[-1]) == n_layers // n_stages  # the last stage never takes an extra layer


@pytest.mark.parametrize("n_stages", [0, 5])
def test_stage_count_out_of_range(n_stages: int) -> None:
    with pytest.raises(ValueError, match=f"Invalid n_stages: {n_stages}"):
        stage_layer_ranges(4, n_stages)
    with pytest.raises(ValueError, match=f"Invalid n_stages: {n_stages}"):
        split_model(Transformer(small_args(), device="meta"), n_stages)


def grads_of(model: Transformer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_stages_in_sequence_equal_the_whole_model(n_stages: int, moe: bool) -> None:
    model = perturbed(small_args(moe=moe, tie=moe))  # the MoE case also covers a tied head across stages
    x, y = tokens()[:, :-1], tokens()[:, 1:]
    whole_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    whole_loss.backward()
    whole_grads = grads_of(model)
    model.zero_grad(set_to_none=True)

    # As a pipeline runs them: each stage's input is a fresh leaf; backward hands gradients stage to stage.
    stages = split_model(model, n_stages)
    inputs, outputs, h = [], [], x
    for stage in stages:
        inputs.append(h)
        outputs.append(stage(h))
        h = outputs[-1].detach().requires_grad_()
    staged_loss = F.cross_entropy(outputs[-1].flatten(0, 1), y.flatten())
    staged_loss.backward()
    for s in reversed(range(n_stages - 1)):
        outputs[s].backward(inputs[s + 1].grad)
    assert torch.equal(staged_loss, whole_loss)
    for name, g in grads_of(model).items():
        assert torch.equal(g, whole_grads[name]), name


def test_split_shares_parameters_and_keeps_names() -> None:
    model = Transformer(small_args(tie=True), device="meta")
    stages = split_model(model, 3)
    assert stages[0].is_first and not stages[0].is_last and stages[-1].is_last
    assert stages[-1].lm_head.weight is stages[0].embed.weight
    model_params = dict(model.named_parameters(remove_duplicate=False))
    for stage in stages:
        for name, p in stage.named_parameters():
            assert model_params[name] is p
    first_middle_layer = stage_layer_ranges(4, 3)[1][0]
    assert next(stages[1].named_parameters())[0] == f"layers.{first_middle_layer}.attn_norm.weight"
    mapping = param_stages(model, 3)
    assert list(mapping) == [n for n, _ in model.named_parameters()]
    assert mapping["embed.weight"] == 0 and mapping["norm.weight"] == 2 and "lm_head.weight" not in mapping
    for s, r in enumerate(stage_layer_ranges(4, 3)):
        assert {mapping[n] for n in mapping if n.split(".")[:2] in [["layers", str(i)] for i in r]} == {s}
    assert param_stages(Transformer(small_args(), device="meta"), 2)["lm_head.weight"] == 1


# ---------------------------------------------------------------- mixture of experts


def make_moe(*, top_k: int = 2, n_shared: int = 0, coef: float = 0.1, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(6, n_experts=4, top_k=top_k, hidden=5, n_shared=n_shared, aux_loss_coef=coef)
    moe = moe.to_empty(device="cpu").double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.5)
    return moe


def test_aux_loss_matches_hand_computation() -> None:
    moe = make_moe()
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    moe(x)
    logits = x.reshape(-1, 6).double().numpy() @ moe.router.weight.detach().double().numpy().T
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    chosen = np.argsort(-probs, axis=1)[:, :2]
    f = np.array([(chosen == i).sum() for i in range(4)]) / chosen.size
    expected = 4 * float((f * probs.mean(0)).sum())
    assert float(moe.last_aux_loss) == pytest.approx(expected, rel=1e-12)
    assert sorted(map(tuple, np.sort(chosen, 1))) == sorted(map(tuple, moe.last_experts.sort(1).values.tolist()))


@pytest.mark.parametrize("n_shared", [0, 1])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_output_matches_per_token_reference(top_k: int, n_shared: int) -> None:
    moe = make_moe(top_k=top_k, n_shared=n_shared)
    x = torch.randn(3, 7, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = moe(x)
    experts = moe.last_experts
    assert experts.shape == (21, top_k)
    assert all(len(set(row)) == top_k for row in experts.tolist())  # exactly k distinct experts per token

    w1, w2, w3 = (w.detach().double() for w in (moe.w1, moe.w2, moe.w3))
    xs = x.reshape(-1, 6).double()
    probs = (xs @ moe.router.weight.detach().double().T).softmax(-1)
    expected = torch.zeros_like(xs)
    for t in range(xs.shape[0]):
        top = probs[t].argsort(descending=True)[:top_k]
        gate = probs[t, top] / (probs[t, top].sum() if top_k > 1 else 1.0)
        for e, g in zip(top.tolist(), gate):
            expected[t] += g * (w2[e] @ (F.silu(w1[e] @ xs[t]) * (w3[e] @ xs[t])))
        if n_shared:
            s1, s2, s3 = (lin.weight.detach().double() for lin in (moe.shared.w1, moe.shared.w2, moe.shared.w3))
            expected[t] += s2 @ (F.silu(s1 @ xs[t]) * (s3 @ xs[t]))
    torch.testing.assert_close(out.reshape(-1, 6), expected.detach(), rtol=1e-12, atol=1e-14)  # float64 both


def router_and_input_grads(moe: MoE, x: torch.Tensor, *, explicit_aux: float = 0.0) -> tuple[torch.Tensor, ...]:
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    loss = (moe(x) * torch.linspace(-1, 1, 6, dtype=torch.float64)).sum()  # stands in for the cross-entropy
    if explicit_aux:
        probs, experts, _ = moe.route(x.reshape(-1, 6))
        loss = loss + explicit_aux * load_balancing_loss(probs, experts, moe.n_experts)
    loss.backward()
    return moe.router.weight.grad.clone(), x.grad.clone()


def test_aux_loss_gradient_reaches_router_through_the_injector() -> None:
    x = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    injected = router_and_input_grads(make_moe(coef=0.3), x)  # backprop of the main loss only
    explicit = router_and_input_grads(make_moe(coef=0.0), x, explicit_aux=0.3)  # CE + 0.3 * aux, by hand
    plain = router_and_input_grads(make_moe(coef=0.0), x)
    for a, b in zip(injected, explicit):  # float64: equal up to summation order
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert (injected[0] - plain[0]).abs().max() > 1e-3  # the balancing term really moved the router gradient

    moe = make_moe(coef=0.3)
    moe.aux_loss_scale = 0.5
    halved = router_and_input_grads(moe, x)
    torch.testing.assert_close(halved[0] - plain[0], 0.5 * (injected[0] - plain[0]), rtol=1e-10, atol=1e-14)


def test_model_aux_loss_sums_layers_and_scale_propagates() -> None:
    model = perturbed(small_args(moe=True))
    assert model.aux_loss() == 0.0  # no forward yet
    model(tokens())
    layers = model.moe_layers()
    assert len(layers) == 3 and model.layers[0].mlp not in layers  # n_dense_layers=1
    assert model.aux_loss() == pytest.approx(sum(float(m.last_aux_loss) for m in layers))
    assert all(m.last_aux_loss > 0 for m in layers)
    model.set_aux_loss_scale(0.25)
    assert {m.aux_loss_scale for m in layers} == {0.25}
    assert Transformer(small_args()).aux_loss() == 0.0
