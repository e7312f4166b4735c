"""Conformance tests for the optimizers, driven by one table of cases (``CASES``).

Every case feeds the same random gradients (from the fixed :data:`SEED`) to ours and to an installed
reference for 30 steps and compares the trajectories. AdamW's and Muon's references are torch's; the others
are pytorch-optimizer's, and a case whose reference is not installed is skipped on its own.
The error measure is ``||x_ours - x_ref|| / ||x_ref - x_0||``: relative to how far the parameters moved, the
strictest scale (a relative error of the parameters themselves would be ~100x smaller here).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

import bubblefree.optim as bo
from bubblefree.optim import OPTIMIZERS, build_optimizer, resolve_defaults
from bubblefree.config import OptimConfig


STEPS = 30
MATRICES = [(24, 16), (16, 24), (24, 16), (20, 20)]
MIXED = MATRICES + [(16,), (3, 8, 12)]


SEED = 1234
"""The seed of every test's parameters and gradients."""


def _seed() -> int:
    return SEED


def _pytorch_optimizer():
    """The reference package of SOAP, Adan, Lion and MARS, or a skip of the one test that needs it."""
    return pytest.importorskip("pytorch_optimizer", reason="the test extra's pytorch-optimizer is not installed")


@dataclass
class Case:
    ours: Callable[..., torch.optim.Optimizer]
    """``ours(params, foreach=...)``."""
    reference: Callable[[list[Tensor]], torch.optim.Optimizer]
    shapes: list[tuple[int, ...]]
    tol: float
    why: str
    tol64: float = 1e-10
    """Tolerance of the same comparison in float64, where only a difference in the math remains."""


def _split(ps: list[Tensor], key: str, **aux) -> list[dict[str, Any]]:
    return [{"params": [p for p in ps if p.ndim >= 2], key: True}, {"params": [p for p in ps if p.ndim < 2],
                                                                     key: False, **aux}]


def _fp32_bf16(self, *args, **kwargs):
    return self.float()


class _MuonFp32NS(torch.optim.Muon):
    """torch.optim.Muon with its own Newton-Schulz code run in fp32: ``grad.bfloat16()`` becomes ``.float()``."""

    def step(self, closure=None):
        with mock.patch.object(torch.Tensor, "bfloat16", _fp32_bf16):
            return super().step(closure)


HP = dict(lr=1e-2, weight_decay=0.1)
CASES: dict[str, Case] = {
    "adamw": Case(
        ours=lambda ps, **kw: bo.AdamW(ps, betas=(0.9, 0.95), **HP, **kw),
        reference=lambda ps: torch.optim.AdamW(ps, betas=(0.9, 0.95), foreach=False, **HP),
        shapes=MIXED, tol=1e-6,
        why="float32 rounding of the Adam step (a few ulps per step), plus the decay bound "
            "(_decay_rounding_bound); float64 agrees to 1e-12"),
    "muon": Case(
        ours=lambda ps, **kw: bo.Muon(ps, lr=0.02, momentum=0.95, weight_decay=0.1, ns_dtype=torch.float32, **kw),
        reference=lambda ps: _MuonFp32NS(ps, lr=0.02, momentum=0.95, weight_decay=0.1),
        shapes=MATRICES, tol=1e-5,
        why="same fp32 NS math; batched bmm versus addmm and fp32 rounding: 2e-6 observed"),
    "lion": Case(
        ours=lambda ps, **kw: bo.Lion(ps, lr=1e-3, betas=(0.95, 0.98), weight_decay=0.5, **kw),
        reference=lambda ps: _pytorch_optimizer().Lion(ps, lr=1e-3, betas=(0.95, 0.98), weight_decay=0.5),
        shapes=MIXED, tol=1e-6,
        why="identical lerp and sign (the signs agree bitwise); only the decay's rounding differs"),
    "adan": Case(
        ours=lambda ps, **kw: bo.Adan(ps, lr=1e-2, weight_decay=0.05, **kw),
        reference=lambda ps: _pytorch_optimizer().Adan(ps, lr=1e-2, weight_decay=0.05),
        shapes=MIXED, tol=1e-5,
        why="same operations in float32; proximal decay computed as (s + lr wd x)/(1 + lr wd) instead of "
            "(x - s)/(1 + lr wd), a few ulps of x per step"),
    "mars": Case(
        ours=lambda ps, **kw: bo.MARS(_split(ps, "use_mars"), lr=1e-2, weight_decay=0.1, adamw_lr=5e-3, **kw),
        reference=lambda ps: _pytorch_optimizer().MARS(ps, lr=1e-2, weight_decay=0.1, lr_1d=5e-3,
                                                    weight_decay_1d=0.1),
        shapes=MIXED[:-1] + [(16,), (8,)], tol=1e-5,
        why="same float32 math for matrices; the 1-D AdamW part places eps as torch does, po inside the sqrt "
            "(relative eps / sqrt(v) ~ 1e-8 here)", tol64=1e-6),
    "soap": Case(
        ours=lambda ps, **kw: bo.SOAP(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, precondition_frequency=3, **kw),
        reference=lambda ps: _pytorch_optimizer().SOAP(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                                                    precondition_frequency=3),
        shapes=MIXED, tol=1e-6,
        why="the reference's float32 operations, so the state is bit-identical (tests/test_soap.py checks it); "
            "only the write x - u rounds differently"),
}


def _params(shapes, seed: int, dtype=torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _grads(shapes, seed: int, steps: int, dtype=torch.float32) -> list[list[Tensor]]:
    """Fresh gradients, each step and tensor with its own scale in [0.01, 3] (exercises MARS's clipping)."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        scales = torch.rand(len(shapes), generator=g, dtype=torch.float64) * 3 + 0.01
        out.append([torch.randn(s, generator=g, dtype=dtype) * float(k) for s, k in zip(shapes, scales)])
    return out


def _run(opt, params, grads) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def _rel(ours, ref, x0) -> float:
    num = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(ours, ref)) ** 0.5
    den = sum(float((b.double() - c.double()).pow(2).sum()) for b, c in zip(ref, x0)) ** 0.5
    return num / den


def _trajectory(make, shapes, seed, steps=STEPS, dtype=torch.float32):
    params = _params(shapes, seed, dtype)
    x0 = [p.detach().clone() for p in params]
    opt = make(params)
    _run(opt, params, _grads(shapes, seed, steps, dtype))
    return x0, [p.detach() for p in params], opt


@pytest.mark.parametrize("name", CASES)
def test_matches_reference(name):
    case, seed = CASES[name], _seed()
    x0, ref, _ = _trajectory(case.reference, case.shapes, seed)
    _, ours, _ = _trajectory(case.ours, case.shapes, seed)
    err, tol = _rel(ours, ref, x0), case.tol + _decay_rounding_bound(x0, ref)
    assert err <= tol, f"{name} seed={seed}: relative error {err:.3g} > {tol:.3g} ({case.why})"


@pytest.mark.parametrize("name", [n for n in CASES if n != "muon"])
def test_matches_reference_in_float64(name):
    # Without float32 rounding the algorithms must agree to float64 precision: this is the exactness check.
    case, seed = CASES[name], _seed()
    x0, ref, _ = _trajectory(case.reference, case.shapes, seed, dtype=torch.float64)
    _, ours, _ = _trajectory(case.ours, case.shapes, seed, dtype=torch.float64)
    assert _rel(ours, ref, x0) < case.tol64, f"{name} seed={seed}"


def _decay_rounding_bound(x0, ref) -> float:
    """What float32 allows when the step is small next to x: each step both sides round x (ours once in
    x - u, the references in (1 - lr wd) x, whose float32 scalar is itself off by up to 2^-25, and again in
    the subtraction), at most 4 half-ulps = 2^-22 |x| per step together. Summed over STEPS steps and taken
    relative to the displacement, that is the bound below (float64 runs show the math itself agrees)."""
    norm = sum(float(b.double().pow(2).sum()) for b in ref) ** 0.5
    moved = sum(float((b.double() - a.double()).pow(2).sum()) for a, b in zip(x0, ref)) ** 0.5
    return STEPS * 2.0**-22 * norm / moved


def test_adamw_exact_in_float64():
    seed = _seed()
    make_ref = lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)  # noqa: E731
    for kw in ({"foreach": False}, {"foreach": True, "fused": False}, {"fused": True}):
        x0, ref, _ = _trajectory(make_ref, MIXED, seed, dtype=torch.float64)
        _, ours, _ = _trajectory(lambda ps: bo.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw), MIXED, seed,
                                 dtype=torch.float64)
        assert _rel(ours, ref, x0) < 1e-12, f"seed={seed} {kw}"


def test_adamw_parameters_relative():
    seed = _seed()
    _, ref, _ = _trajectory(CASES["adamw"].reference, MIXED, seed)
    _, ours, _ = _trajectory(CASES["adamw"].ours, MIXED, seed)
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(ours, ref)) ** 0.5
    assert num / sum(float(b.pow(2).sum()) for b in ref) ** 0.5 <= 1e-6, f"seed={seed}"


FAST_PATHS = [(n, {"foreach": True}) for n in CASES] + [("adamw", {"foreach": True, "fused": False})]


@pytest.mark.parametrize(("name", "fast"), FAST_PATHS)
def test_fast_path_matches_per_tensor_path(name, fast):
    case, seed = CASES[name], _seed()
    x0, ref, _ = _trajectory(lambda ps: case.ours(ps, foreach=False), case.shapes, seed)
    _, ours, _ = _trajectory(lambda ps: case.ours(ps, **fast), case.shapes, seed)
    assert _rel(ours, ref, x0) <= 1e-6, f"{name} {fast} seed={seed}"


@pytest.mark.parametrize("name", CASES)
def test_state_dict_round_trip_continues_identically(name):
    case, seed = CASES[name], _seed()
    grads = _grads(case.shapes, seed, 20)
    params = _params(case.shapes, seed)
    opt = case.ours(params)
    _run(opt, params, grads[:10])
    saved = copy.deepcopy(opt.state_dict())
    restart = [nn.Parameter(p.detach().clone()) for p in params]
    _run(opt, params, grads[10:])
    fresh = case.ours(restart)
    fresh.load_state_dict(saved)
    _run(fresh, restart, grads[10:])
    assert all(torch.equal(a, b) for a, b in zip(params, restart)), f"seed={seed}"
    assert set(saved["state"][0]) >= {"step"} or name == "muon"


@pytest.mark.parametrize("name", CASES)
def test_compute_updates_is_pure_and_fresh(name):
    case, seed = CASES[name], _seed()
    params = _params(case.shapes, seed)
    opt = case.ours(params)
    for step, step_grads in enumerate(_grads(case.shapes, seed, 3)):
        for p, g in zip(params, step_grads):
            p.grad = g
        before = [(p.detach().clone(), p.grad.clone()) for p in params]
        updates = opt.compute_updates()
        assert all(torch.equal(p, x) and torch.equal(p.grad, g) for p, (x, g) in zip(params, before))
        state_ptrs = {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values()
                      if isinstance(t, Tensor)}
        state_ptrs |= {t.untyped_storage().data_ptr() for p in params for t in (p, p.grad)}
        assert all(u.untyped_storage().data_ptr() not in state_ptrs for u in updates)
        if step == 0:
            kept = [u.clone() for u in updates]
            first = updates
    assert all(torch.equal(a, b) for a, b in zip(first, kept)), "a later step changed an earlier update"


@pytest.mark.parametrize("name", CASES)
def test_step_is_apply_of_compute_updates(name):
    case, seed = CASES[name], _seed()
    a, b = _params(case.shapes, seed), _params(case.shapes, seed)
    opt_a, opt_b = case.ours(a), case.ours(b)
    for step_grads in _grads(case.shapes, seed, 3):
        for pa, pb, g in zip(a, b, step_grads):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        bo.apply_updates(opt_b.params(), opt_b.compute_updates())
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", CASES)
def test_lr_scheduler_changes_apply(name):
    case, seed = CASES[name], _seed()
    a, b = _params(case.shapes, seed), _params(case.shapes, seed)
    opt_a, opt_b = case.ours(a), case.ours(b)
    for group in opt_b.param_groups:
        group["lr"] *= 0.25
    sched = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda step: 0.25)
    _run(opt_a, a, _grads(case.shapes, seed, 3))
    _run(opt_b, b, _grads(case.shapes, seed, 3))
    sched.step()
    assert all(torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b)), f"seed={seed}"


def test_muon_batches_3d_params_as_matrices_and_in_bfloat16_close():
    seed = _seed()
    experts = _params([(4, 12, 20)], seed)
    single = [nn.Parameter(e.detach().clone()) for e in experts[0]]
    opt_e, opt_s = bo.Muon(experts, weight_decay=0.1), bo.Muon(single, weight_decay=0.1, foreach=False)
    grads = _grads([(4, 12, 20)], seed, 5)
    _run(opt_e, experts, grads)
    _run(opt_s, single, [[g for g in gs[0]] for gs in grads])
    assert torch.allclose(experts[0].detach(), torch.stack([p.detach() for p in single]), rtol=0, atol=1e-6)
    x0, ref, _ = _trajectory(CASES["muon"].reference, MATRICES, seed)
    _, bf16, _ = _trajectory(lambda ps: bo.Muon(ps, weight_decay=0.1, ns_dtype=torch.bfloat16), MATRICES, seed)
    assert _rel(bf16, ref, x0) < 3e-2, "bf16 NS should stay within its rounding (~1e-2) of the fp32 reference"


BAD = [
    (lambda: bo.AdamW([nn.Parameter(torch.ones(2))], lr=-1.0), "lr", "-1.0"),
    (lambda: bo.AdamW([nn.Parameter(torch.ones(2))], betas=(1.0, 0.9)), "betas[0]", "1.0"),
    (lambda: bo.Lion([nn.Parameter(torch.ones(2))], betas=(0.9, -0.1)), "betas[1]", "-0.1"),
    (lambda: bo.Adan([nn.Parameter(torch.ones(2))], weight_decay=-0.5), "weight_decay", "-0.5"),
    (lambda: bo.Muon([nn.Parameter(torch.ones(2, 2))], momentum=1.5), "momentum", "1.5"),
    (lambda: bo.Muon([nn.Parameter(torch.ones(7))]), "Muon", "(7,)"),
    (lambda: bo.Muon([nn.Parameter(torch.ones(2, 2))], adjust_lr="spectral"), "adjust_lr", "spectral"),
    (lambda: bo.MARS([nn.Parameter(torch.ones(2, 2))], gamma=-1.0), "gamma", "-1.0"),
    (lambda: build_optimizer(nn.Linear(2, 2), OptimConfig(name="sgd")), "optim.name", "sgd"),
    (lambda: build_optimizer(nn.Linear(2, 2), OptimConfig(name="muon", momentum=1.0)), "optim.momentum", "1.0"),
]


@pytest.mark.parametrize(("make", "name", "value"), BAD)
def test_bad_input_raises_value_error_naming_it(make, name, value):
    with pytest.raises(ValueError) as info:
        make()
    assert name in str(info.value) and value in str(info.value)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="adamw, adan, lion, mars, muon"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(name="sgd"))


class TinyLM(nn.Module):
    """LLaMA-shaped names (embed, layers.N..., norm, lm_head) from torch.nn pieces."""

    def __init__(self, vocab=32, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.SiLU(),
                                                  nn.Linear(2 * dim, dim)) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.lm_head(self.norm(h))


def test_build_optimizer_routes_and_maps_momentum():
    model = TinyLM()
    opt = build_optimizer(model, OptimConfig(name="muon", momentum=0.9, adamw_lr=1e-3))
    names = {id(p): n for n, p in model.named_parameters()}
    muon_group, adam_group = opt.param_groups
    assert sorted(names[id(p)] for p in muon_group["params"]) == [f"layers.{i}.{j}.weight" for i in (0, 1)
                                                                   for j in (1, 3)]
    assert muon_group["use_muon"] and muon_group["momentum"] == 0.9 and muon_group["lr"] == 0.02
    assert not adam_group["use_muon"] and adam_group["lr"] == 1e-3 and adam_group["weight_decay"] == 0.1
    assert {"embed.weight", "lm_head.weight", "norm.weight"} <= {names[id(p)] for p in adam_group["params"]}
    assert build_optimizer(model, OptimConfig(name="adan", momentum=0.9)).param_groups[0]["betas"][0] == 0.9
    assert build_optimizer(model, OptimConfig(name="lion", momentum=0.99)).param_groups[0]["betas"] == (0.975, 0.99)
    assert build_optimizer(model, OptimConfig(name="adamw", lr=1e-3)).param_groups[0]["lr"] == 1e-3


def test_max_precond_dim_reaches_soap_and_leaves_the_vocabulary_unpreconditioned():
    model = TinyLM(vocab=64, dim=16)
    opt = build_optimizer(model, OptimConfig(name="soap", max_precond_dim=32))
    assert opt.param_groups[0]["max_precond_dim"] == 32
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    grams = {n: [None if g is None else tuple(g.shape) for g in opt.state[p]["GG"]]
             for n, p in model.named_parameters()}
    assert grams["embed.weight"] == [None, (16, 16)] and grams["lm_head.weight"] == [None, (16, 16)]
    assert grams["layers.0.1.weight"] == [(32, 32), (16, 16)]
    # 0 keeps SOAP's own default; the other optimizers have no such knob and ignore it.
    assert build_optimizer(model, OptimConfig(name="soap")).param_groups[0]["max_precond_dim"] == 10000
    assert "max_precond_dim" not in build_optimizer(model, OptimConfig(name="adamw", max_precond_dim=32)).defaults


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_registry_defaults_are_the_class_defaults(name):
    spec = OPTIMIZERS[name]
    sig = inspect.signature(spec.cls).parameters
    assert sig["lr"].default == spec.lr and sig["weight_decay"].default == spec.weight_decay
    if spec.betas is not None:
        assert tuple(sig["betas"].default) == spec.betas
    if spec.route_key is not None:
        assert sig["adamw_lr"].default == spec.adamw_lr
    assert spec.max_precond_dim == (sig["max_precond_dim"].default if "max_precond_dim" in sig else 0)
    default = {"betas": spec.betas} if spec.betas is not None else {"momentum": sig["momentum"].default}
    assert spec.momentum_kwargs(spec.momentum) == default


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resolved_defaults_build_the_same_optimizer(name):
    # What a run records (the resolved config) must build what the unresolved one builds, hyperparameter for
    # hyperparameter, and resolving twice changes nothing.
    model = TinyLM(vocab=64, dim=16)
    cfg = OptimConfig(name=name)
    resolved = resolve_defaults(cfg)
    assert resolved.lr > 0 and resolved.momentum >= 0 and resolve_defaults(resolved) == resolved
    assert (resolved.adamw_lr > 0) == (OPTIMIZERS[name].route_key is not None)
    assert (resolved.max_precond_dim > 0) == ("max_precond_dim" in inspect.signature(OPTIMIZERS[name].cls).parameters)
    built = [build_optimizer(model, c).param_groups for c in (cfg, resolved)]
    strip = lambda groups: [{k: v for k, v in g.items() if k != "params"} for g in groups]
    assert strip(built[0]) == strip(built[1])
    assert strip(built[0])[0]["lr"] == OPTIMIZERS[name].lr


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_reduces_the_loss(name):
    # A copy task the model can learn by heart in 30 steps; to move to the trainer's smoke preset.
    torch.manual_seed(0)
    model = TinyLM()
    # The registry's lrs are for 100M-parameter LLMs; a 30-step toy wants larger ones (Lion's stays 3x lower).
    lr = {"lion": 3e-3, "muon": 0.02}.get(name, 1e-2)
    opt = build_optimizer(model, OptimConfig(name=name, lr=lr, adamw_lr=1e-2, weight_decay=0.0))
    tokens = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], (name, losses)
