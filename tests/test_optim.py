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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

import bubblefree.optim as bo
from bubblefree.config import OptimConfig
from bubblefree.optim import OPTIMIZERS, build_optimizer, resolve_defaults
from bubblefree.optim.adamw import init_adamw_state
from helpers import (
    SEED,
    pytorch_optimizer,
    random_grads,
    random_params,
    relative_error,
    run_steps,
    trajectory,
    write_rounding_bound,
)

STEPS = 30
MATRICES = [(24, 16), (16, 24), (24, 16), (20, 20)]
MIXED = MATRICES + [(16,), (3, 8, 12)]


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
            "(write_rounding_bound); float64 agrees to 1e-12"),
    "muon": Case(
        ours=lambda ps, **kw: bo.Muon(ps, lr=0.02, momentum=0.95, weight_decay=0.1, ns_dtype=torch.float32, **kw),
        reference=lambda ps: _MuonFp32NS(ps, lr=0.02, momentum=0.95, weight_decay=0.1),
        shapes=MATRICES, tol=1e-5,
        why="same fp32 NS math; batched bmm versus addmm and fp32 rounding: 2e-6 observed"),
    "lion": Case(
        ours=lambda ps, **kw: bo.Lion(ps, lr=1e-3, betas=(0.95, 0.98), weight_decay=0.5, **kw),
        reference=lambda ps: pytorch_optimizer().Lion(ps, lr=1e-3, betas=(0.95, 0.98), weight_decay=0.5),
        shapes=MIXED, tol=1e-6,
        why="identical lerp and sign (the signs agree bitwise); only the decay's rounding differs"),
    "adan": Case(
        ours=lambda ps, **kw: bo.Adan(ps, lr=1e-2, weight_decay=0.05, **kw),
        reference=lambda ps: pytorch_optimizer().Adan(ps, lr=1e-2, weight_decay=0.05),
        shapes=MIXED, tol=1e-5,
        why="same operations in float32; proximal decay computed as (s + lr wd x)/(1 + lr wd) instead of "
            "(x - s)/(1 + lr wd), a few ulps of x per step"),
    "mars": Case(
        ours=lambda ps, **kw: bo.MARS(_split(ps, "use_mars"), lr=1e-2, weight_decay=0.1, adamw_lr=5e-3, **kw),
        reference=lambda ps: pytorch_optimizer().MARS(ps, lr=1e-2, weight_decay=0.1, lr_1d=5e-3,
                                                    weight_decay_1d=0.1),
        shapes=MIXED[:-1] + [(16,), (8,)], tol=1e-5,
        why="same float32 math for matrices; the 1-D AdamW part places eps as torch does, po inside the sqrt "
            "(relative eps / sqrt(v) ~ 1e-8 here)", tol64=1e-6),
    "soap": Case(
        ours=lambda ps, **kw: bo.SOAP(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, precondition_frequency=3, **kw),
        reference=lambda ps: pytorch_optimizer().SOAP(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                                                    precondition_frequency=3),
        shapes=MIXED, tol=1e-6,
        why="the reference's float32 operations, so the state is bit-identical (tests/test_soap.py checks it); "
            "only the write x - u rounds differently"),
    "nadamw": Case(
        ours=lambda ps, **kw: bo.NAdamW(ps, betas=(0.99, 0.999), momentum_decay=0.04, **HP, **kw),
        reference=lambda ps: torch.optim.NAdam(ps, betas=(0.99, 0.999), momentum_decay=0.04,
                                               decoupled_weight_decay=True, foreach=False, **HP),
        shapes=MIXED, tol=1e-6,
        why="torch's operations and its float32 mu_product; only the decay's rounding differs (momentum_decay "
            "0.04, ten times torch's, so the momentum schedule moves within the 30 steps)"),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_reference(name):
    case, seed = CASES[name], SEED
    x0, ref, _ = trajectory(case.reference, case.shapes, STEPS)
    _, ours, _ = trajectory(case.ours, case.shapes, STEPS)
    err, tol = relative_error(ours, ref, x0), case.tol + write_rounding_bound(x0, ref, STEPS)
    assert err <= tol, f"{name} seed={seed}: relative error {err:.3g} > {tol:.3g} ({case.why})"


@pytest.mark.parametrize("name", [n for n in CASES if n != "muon"])
def test_matches_reference_in_float64(name):
    # Without float32 rounding the algorithms must agree to float64 precision: this is the exactness check.
    case, seed = CASES[name], SEED
    x0, ref, _ = trajectory(case.reference, case.shapes, STEPS, dtype=torch.float64)
    _, ours, _ = trajectory(case.ours, case.shapes, STEPS, dtype=torch.float64)
    assert relative_error(ours, ref, x0) < case.tol64, f"{name} seed={seed}"


def test_adamw_exact_in_float64():
    seed = SEED
    make_ref = lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)  # noqa: E731
    for kw in ({"foreach": False}, {"foreach": True, "fused": False}, {"fused": True}):
        x0, ref, _ = trajectory(make_ref, MIXED, STEPS, dtype=torch.float64)
        _, ours, _ = trajectory(lambda ps, kw=kw: bo.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw), MIXED, STEPS,
                                dtype=torch.float64)
        assert relative_error(ours, ref, x0) < 1e-12, f"seed={seed} {kw}"


def test_nadamw_matches_torch_over_many_steps():
    # Ajanthan et al.'s setting (beta1 0.99, beta2 0.999, torch's momentum_decay 0.004) over 300 steps, and a
    # fast schedule (0.05: mu_t near beta1 by the end) whose every term matters. float64 is the exactness check
    # (a 1 % change of momentum_decay moves the result by ~1e-4 there); float32 must stay within the rounding
    # bound above, scaled to the 300 steps.
    seed, steps = SEED, 300
    for psi in (4e-3, 5e-2):
        hp = dict(lr=1e-3, betas=(0.99, 0.999), weight_decay=0.1, momentum_decay=psi)
        make_ref = lambda ps, hp=hp: torch.optim.NAdam(ps, decoupled_weight_decay=True, **hp)
        make_ours = lambda ps, hp=hp: bo.NAdamW(ps, **hp)
        for dtype in (torch.float64, torch.float32):
            x0, ref, ref_opt = trajectory(make_ref, MIXED, steps, seed=seed, dtype=dtype)
            _, ours, opt = trajectory(make_ours, MIXED, steps, seed=seed, dtype=dtype)
            tol = 1e-10 if dtype == torch.float64 else 1e-6 + write_rounding_bound(x0, ref, steps)
            assert relative_error(ours, ref, x0) <= tol, f"momentum_decay={psi} {dtype} seed={seed}"
            p, q = opt.params()[0], ref_opt.param_groups[0]["params"][0]
            assert torch.equal(opt.state[p]["mu_product"], ref_opt.state[q]["mu_product"]), "mu_product as torch's"


def test_adamw_parameters_relative():
    seed = SEED
    _, ref, _ = trajectory(CASES["adamw"].reference, MIXED, STEPS)
    _, ours, _ = trajectory(CASES["adamw"].ours, MIXED, STEPS)
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(ours, ref)) ** 0.5
    assert num / sum(float(b.pow(2).sum()) for b in ref) ** 0.5 <= 1e-6, f"seed={seed}"


FAST_PATHS = [(n, {"foreach": True}) for n in CASES] + [("adamw", {"foreach": True, "fused": False})]


@pytest.mark.parametrize(("name", "fast"), FAST_PATHS)
def test_fast_path_matches_per_tensor_path(name, fast):
    case, seed = CASES[name], SEED
    x0, ref, _ = trajectory(lambda ps: case.ours(ps, foreach=False), case.shapes, STEPS)
    _, ours, _ = trajectory(lambda ps: case.ours(ps, **fast), case.shapes, STEPS)
    assert relative_error(ours, ref, x0) <= 1e-6, f"{name} {fast} seed={seed}"


@pytest.mark.parametrize("name", CASES)
def test_state_dict_round_trip_continues_identically(name):
    case, seed = CASES[name], SEED
    grads = random_grads(case.shapes, 20, seed)
    params = random_params(case.shapes, seed)
    opt = case.ours(params)
    run_steps(opt, params, grads[:10])
    saved = copy.deepcopy(opt.state_dict())
    restart = [nn.Parameter(p.detach().clone()) for p in params]
    run_steps(opt, params, grads[10:])
    fresh = case.ours(restart)
    fresh.load_state_dict(saved)
    run_steps(fresh, restart, grads[10:])
    assert all(torch.equal(a, b) for a, b in zip(params, restart)), f"seed={seed}"
    assert set(saved["state"][0]) >= {"step"} or name == "muon"


def test_a_loaded_adamw_step_moves_to_its_parameters_device():
    """A checkpoint written on one device and resumed on another: torch's load_state_dict leaves ``step``
    where it was saved, and torch's fused Adam kernel on CUDA refuses a CPU ``step`` (found on an H200: a
    CPU checkpoint resumed on the GPU stopped at its first step). The "meta" device stands in for the GPU
    (no kernel runs there, so the check stops at the state's book-keeping, which every AdamW group runs
    first): the step must follow the parameter, as the moments do."""
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
    saved = bo.AdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    saved.step()
    elsewhere = [nn.Parameter(torch.empty_like(p, device="meta")) for p in params]
    opt = bo.AdamW(elsewhere)
    opt.load_state_dict(saved.state_dict())
    assert all(opt.state[p]["exp_avg"].is_meta and not opt.state[p]["step"].is_meta for p in elsewhere)
    for p in elsewhere:
        init_adamw_state(opt.state[p], p)
    assert all(opt.state[p]["step"].is_meta and opt.state[p]["step"].dtype == torch.float32 for p in elsewhere)


@pytest.mark.parametrize("name", CASES)
def test_compute_updates_is_pure_and_fresh(name):
    case, seed = CASES[name], SEED
    params = random_params(case.shapes, seed)
    opt = case.ours(params)
    for step, step_grads in enumerate(random_grads(case.shapes, 3, seed)):
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
    case, seed = CASES[name], SEED
    a, b = random_params(case.shapes, seed), random_params(case.shapes, seed)
    opt_a, opt_b = case.ours(a), case.ours(b)
    for step_grads in random_grads(case.shapes, 3, seed):
        for pa, pb, g in zip(a, b, step_grads):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        bo.apply_updates(opt_b.params(), opt_b.compute_updates())
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", CASES)
def test_lr_scheduler_changes_apply(name):
    case, seed = CASES[name], SEED
    a, b = random_params(case.shapes, seed), random_params(case.shapes, seed)
    opt_a, opt_b = case.ours(a), case.ours(b)
    for group in opt_b.param_groups:
        group["lr"] *= 0.25
    sched = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda step: 0.25)
    run_steps(opt_a, a, random_grads(case.shapes, 3, seed))
    run_steps(opt_b, b, random_grads(case.shapes, 3, seed))
    sched.step()
    assert all(torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b)), f"seed={seed}"


def test_muon_batches_3d_params_as_matrices_and_in_bfloat16_close():
    seed = SEED
    experts = random_params([(4, 12, 20)], seed)
    single = [nn.Parameter(e.detach().clone()) for e in experts[0]]
    opt_e, opt_s = bo.Muon(experts, weight_decay=0.1), bo.Muon(single, weight_decay=0.1, foreach=False)
    grads = random_grads([(4, 12, 20)], 5, seed)
    run_steps(opt_e, experts, grads)
    run_steps(opt_s, single, [[g for g in gs[0]] for gs in grads])
    assert torch.allclose(experts[0].detach(), torch.stack([p.detach() for p in single]), rtol=0, atol=1e-6)
    x0, ref, _ = trajectory(CASES["muon"].reference, MATRICES, STEPS)
    _, bf16, _ = trajectory(lambda ps: bo.Muon(ps, weight_decay=0.1, ns_dtype=torch.bfloat16), MATRICES, STEPS)
    assert relative_error(bf16, ref, x0) < 3e-2, "bf16 NS should stay within its rounding (~1e-2) of the fp32 reference"


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
def test_momentum_free_is_what_the_knob_at_zero_does(name):
    """``OptimizerSpec.momentum_free``: at ``optim.momentum = 0`` a momentum-free rule reads past gradients
    only through sign-blind statistics (second moments, Gram matrices), so flipping the sign of the previous
    gradient leaves the update unchanged; a momentum (the default knob's, or Adan's average of gradient
    differences at any knob) moves it. Three steps, the middle gradient flipped (SOAP's first step only builds
    its basis); on a hidden matrix, so the property is the matrix rule's."""
    gen = torch.Generator().manual_seed(SEED)
    g0, g1, g2, w = (torch.randn(12, 8, generator=gen) for _ in range(4))

    def last_update(momentum: float, middle: Tensor) -> Tensor:
        holder = nn.Module()
        holder.w = nn.Parameter(w.clone())
        opt = build_optimizer(holder, OptimConfig(name=name, momentum=momentum, weight_decay=0.0))
        for g in (g0, middle, g2):  # compute_updates leaves w alone: every update is taken at the same point
            holder.w.grad = g.clone()
            update = opt.compute_updates()[0]
        return update

    assert torch.equal(last_update(0.0, g1), last_update(0.0, -g1)) == OPTIMIZERS[name].momentum_free
    assert not torch.equal(last_update(-1.0, g1), last_update(-1.0, -g1))  # the default has a momentum


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
