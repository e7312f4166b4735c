"""SOAP (bubblefree.optim.soap) against pytorch-optimizer 4.1.0's SOAP and against a hand derivation.

Every test takes its parameters and gradients from the fixed :data:`SEED`. Gradients are random
tensors, not functions of the parameters, so the optimizer state (GG, Q, exp_avg, exp_avg_sq) depends on
the gradients alone: running the reference's floating-point operations on the same gradients must give
the *same bits* of state, even where the eigenbasis is ambiguous (the null space of G G^T for a wide
6 x 10 gradient). Only the write ``x - u`` rounds differently from the reference's ``(x - s N)(1 - lr wd)``.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import Tensor, nn

from bubblefree.optim.base import apply_updates
from bubblefree.optim.soap import SOAP
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

STEPS = 31
PF = 3  # refreshes at k = 3, 6, ..., 30: ten QR power iterations in a run
MAX_DIM = 32
# Square, wide and tall (rank-deficient G G^T at first), a dimension over MAX_DIM (identity basis), 1-D
# (Adam), and an order-3 tensor (three bases).
SHAPES = [(8, 8), (6, 10), (10, 6), (5, 40), (40, 5), (16,), (4, 3, 5)]
HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, precondition_frequency=PF, eps=1e-8)


def _ours(params, **kw) -> SOAP:
    return SOAP(params, max_precond_dim=MAX_DIM, **HP, **kw)


def _reference(params) -> torch.optim.Optimizer:
    return pytorch_optimizer().SOAP(params, max_precondition_dim=MAX_DIM, **HP)


@pytest.mark.parametrize("foreach", [False, True])
def test_matches_pytorch_optimizer_soap(foreach):
    seed = SEED
    x0, ref, ref_opt = trajectory(_reference, SHAPES, STEPS)
    _, ours, our_opt = trajectory(lambda ps: _ours(ps, foreach=foreach), SHAPES, STEPS)
    for i, (a, b) in enumerate(zip(ours, ref)):
        mine, theirs = our_opt.state[a], ref_opt.state[b]
        assert int(mine["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[key], theirs[key]), f"seed={seed} param {i} {key}"
        for key in ("GG", "Q"):
            assert len(mine[key]) == len(theirs[key])
            for j, (m, t) in enumerate(zip(mine[key], theirs[key])):
                assert (m is None) == (len(t) == 0), f"seed={seed} param {i} {key}[{j}]"
                assert m is None or torch.equal(m, t), f"seed={seed} param {i} {key}[{j}]"
    # 1e-6 for the step's own float32 rounding (5e-7 observed with wd = 0) plus the write's rounding.
    err, tol = relative_error(ours, ref, x0), 1e-6 + write_rounding_bound(x0, ref, STEPS)
    assert err <= tol, f"seed={seed}: relative error {err:.3g} > {tol:.3g}"


def test_matches_pytorch_optimizer_soap_in_float64():
    # Same math, QR in float32 on both sides: only float64 rounding of the write is left.
    seed = SEED
    x0, ref, _ = trajectory(_reference, SHAPES, STEPS, dtype=torch.float64)
    _, ours, _ = trajectory(_ours, SHAPES, STEPS, dtype=torch.float64)
    assert relative_error(ours, ref, x0) < 1e-12, f"seed={seed}"


def test_precondition_1d_matches_pytorch_optimizer_soap():
    seed = SEED
    gen = torch.Generator().manual_seed(seed)
    shapes = [(12,), (6, 4), (40,)]  # 40 > MAX_DIM keeps the identity even with precondition_1d
    x0 = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(10)]
    ours, ref = ([nn.Parameter(x.clone()) for x in x0] for _ in range(2))
    run_steps(_ours(ours, precondition_1d=True), ours, grads)
    run_steps(pytorch_optimizer().SOAP(ref, max_precondition_dim=MAX_DIM, precondition_1d=True, **HP), ref, grads)
    err = relative_error(ours, ref, x0)
    assert err <= 1e-6 + write_rounding_bound(x0, ref, 10), f"seed={seed}: {err:.3g}"


def test_bfloat16_parameters_stay_close_to_float32():
    """bf16 parameters keep bf16 state and matmuls (eigh and QR in float32). Fed the same bf16 values, the
    summed updates of 8 steps stay within 0.3 of float32's (0.10-0.15 measured over 6 seeds: the early
    steps are nearly sign(Q^T G Q), which bf16 rounding of Q flips for entries near zero)."""
    seed = SEED
    p16 = random_params(SHAPES, seed, torch.bfloat16)
    p32 = [nn.Parameter(p.detach().float()) for p in p16]
    o16, o32 = _ours(p16), _ours(p32)
    tot16, tot32 = [torch.zeros_like(p) for p in p32], [torch.zeros_like(p) for p in p32]
    for step_grads in random_grads(SHAPES, 8, seed):
        for a, b, g in zip(p16, p32, step_grads):
            a.grad = g.to(torch.bfloat16)
            b.grad = a.grad.float()
        for t16, t32, u16, u32 in zip(tot16, tot32, o16.compute_updates(), o32.compute_updates()):
            assert u16.dtype == torch.bfloat16 and torch.isfinite(u16).all()
            t16 += u16.float()
            t32 += u32
    err = relative_error(tot16, tot32, [torch.zeros_like(t) for t in tot32])
    assert err < 0.3, f"seed={seed}: {err:.3g}"


def test_foreach_path_is_bitwise_the_reference_path():
    seed = SEED
    _, single, _ = trajectory(lambda ps: _ours(ps, foreach=False), SHAPES, STEPS)
    _, batched, _ = trajectory(lambda ps: _ours(ps, foreach=True), SHAPES, STEPS)
    assert all(torch.equal(a, b) for a, b in zip(single, batched)), f"seed={seed}"


def test_first_two_steps_match_the_hand_derivation():
    """Step 1 is zero. Step 2 from float64 SVDs: for a square G1 = U S V^T the Shampoo bases after step 1
    are U and V (L, R are (1-b) G1 G1^T, (1-b) G1^T G1 with distinct eigenvalues), m = (1-b1) G2,
    v = (1-b2) (U^T G2 V)^2, and with bias corrections s = lr sqrt(1-b2) / (1-b1),
    u = s U [(1-b1) Y / (sqrt(1-b2) |Y| + eps)] V^T + lr wd (x - s N), Y = U^T G2 V. 1-D: the same with U = V = 1."""
    seed = SEED
    gen = torch.Generator().manual_seed(seed)
    lr, (b1, b2), eps, wd = HP["lr"], HP["betas"], 1e-3, HP["weight_decay"]  # eps large enough to matter
    # float64, so that the comparison is with the math and not with float32 eigenvectors (whose error
    # eps * |L| / gap the eps-softened sign below would amplify up to (1 - b1) / eps = 100 times).
    x = [nn.Parameter(torch.randn(7, 7, generator=gen, dtype=torch.float64)),
         nn.Parameter(torch.randn(9, generator=gen, dtype=torch.float64))]
    g1, g2 = ([torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in x] for _ in range(2))
    opt = SOAP(x, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for p, g in zip(x, g1):
        p.grad = g
    assert all(torch.equal(u, torch.zeros_like(p)) for u, p in zip(opt.compute_updates(), x))
    for p, g in zip(x, g2):
        p.grad = g
    ours = opt.compute_updates()

    s = lr * math.sqrt(1 - b2) / (1 - b1)
    u_mat, _, vt = torch.linalg.svd(g1[0])
    y = u_mat.T @ g2[0] @ vt.T
    direction = [u_mat @ ((1 - b1) * y / (math.sqrt(1 - b2) * y.abs() + eps)) @ vt,
                 (1 - b1) * g2[1] / (math.sqrt(1 - b2) * g2[1].abs() + eps)]
    for u, n, p in zip(ours, direction, x):
        expected = s * n + lr * wd * (p - s * n)
        # eigh versus SVD in float64: 1e-9 leaves room for a gap 1e5 times smaller than |L|.
        torch.testing.assert_close(u, expected, rtol=0, atol=1e-9 * lr, msg=lambda m: f"seed={seed}: {m}")


def test_state_dict_round_trip_continues_identically():
    seed = SEED
    grads = random_grads(SHAPES, 14, seed)
    params = random_params(SHAPES, seed)
    opt = _ours(params)
    run_steps(opt, params, grads[:7])  # mid-way between the refreshes at k = 6 and k = 9
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    restart = [nn.Parameter(p.detach().clone()) for p in params]
    run_steps(opt, params, grads[7:])
    fresh = _ours(restart)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    run_steps(fresh, restart, grads[7:])
    assert all(torch.equal(a, b) for a, b in zip(params, restart)), f"seed={seed}"
    assert {"step", "exp_avg", "exp_avg_sq", "GG", "Q"} == set(fresh.state_dict()["state"][0])


def test_compute_updates_reads_only_and_returns_fresh_tensors():
    seed = SEED
    params = random_params(SHAPES, seed)
    opt, twin = _ours(params), _ours([nn.Parameter(p.detach().clone()) for p in params])
    kept = []
    for step_grads in random_grads(SHAPES, 5, seed):
        for p, q, g in zip(params, twin.params(), step_grads):
            p.grad, q.grad = g, g.clone()
        before = [(p.detach().clone(), p.grad.clone()) for p in params]
        updates = opt.compute_updates()
        assert all(torch.equal(p, x) and torch.equal(p.grad, g) for p, (x, g) in zip(params, before))
        owned = {t.untyped_storage().data_ptr() for p in params for t in (p, p.grad)}
        for s in opt.state.values():
            owned |= {t.untyped_storage().data_ptr() for v in s.values()
                      for t in (v if isinstance(v, list) else [v]) if isinstance(t, Tensor)}
        assert not any(u.untyped_storage().data_ptr() in owned for u in updates)
        kept.append((updates, [u.clone() for u in updates]))
        apply_updates(params, updates)
        twin.step()
    assert all(torch.equal(a, b) for live, copies in kept for a, b in zip(live, copies)), "an update was mutated"
    assert all(torch.equal(a, b) for a, b in zip(params, twin.params())), "step() != apply(compute_updates())"


def test_lr_change_between_steps_is_honoured():
    # The schedule writes group["lr"] between steps; without decay u is linear in the lr of its own step.
    seed = SEED
    a, b = random_params(SHAPES, seed), random_params(SHAPES, seed)
    opt_a, opt_b = _ours(a, foreach=True), _ours(b, foreach=True)
    for opt in (opt_a, opt_b):
        opt.param_groups[0]["weight_decay"] = 0.0
    grads = random_grads(SHAPES, 4, seed)
    run_steps(opt_a, a, grads[:3])
    run_steps(opt_b, b, grads[:3])
    opt_a.param_groups[0]["lr"] = 0.5 * HP["lr"]
    for p, q, g in zip(a, b, grads[3]):
        p.grad, q.grad = g.clone(), g.clone()
    for half, full in zip(opt_a.compute_updates(), opt_b.compute_updates()):
        torch.testing.assert_close(half, 0.5 * full, rtol=1e-6, atol=0, msg=lambda m: f"seed={seed}: {m}")


BAD = [
    (dict(lr=-1.0), "lr", "-1.0"),
    (dict(betas=(1.0, 0.95)), "betas[0]", "1.0"),
    (dict(betas=(0.9, -0.1)), "betas[1]", "-0.1"),
    (dict(betas=(0.9,)), "betas", "(0.9,)"),
    (dict(shampoo_beta=1.5), "shampoo_beta", "1.5"),
    (dict(eps=-1e-8), "eps", "-1e-08"),
    (dict(weight_decay=float("nan")), "weight_decay", "nan"),
    (dict(precondition_frequency=0), "precondition_frequency", "0"),
    (dict(precondition_frequency=2.5), "precondition_frequency", "2.5"),
    (dict(max_precond_dim=0), "max_precond_dim", "0"),
]


@pytest.mark.parametrize(("kwargs", "name", "value"), BAD)
def test_bad_hyperparameters_raise_value_error_naming_them(kwargs, name, value):
    with pytest.raises(ValueError) as info:
        SOAP([nn.Parameter(torch.ones(2, 2))], **kwargs)
    assert name in str(info.value) and value in str(info.value)


def test_complex_parameters_are_rejected():
    p = nn.Parameter(torch.ones(2, 2, dtype=torch.complex64))
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="complex"):
        SOAP([p]).step()
