"""Recycled update buffers (optim.base) and storage rotation (delay.delayed): faster, never different.

If a recycled buffer were still read by anyone (an EF ring entry, a stash slot, optimizer state), the
trajectory would change; so each test runs the same steps with recycling switched off and demands equality
bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bubblefree.optim as bo
from bubblefree.delay import DelayedOptimizer

SHAPES = [(12, 8), (8, 12), (8,), (5, 4, 3)]
MAKERS = {
    "adamw": lambda ps: bo.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "lion": lambda ps: bo.Lion(ps, lr=1e-3),
    "adan": lambda ps: bo.Adan(ps, lr=1e-2),
    "mars": lambda ps: bo.MARS(ps, lr=1e-2),
    "muon": lambda ps: bo.Muon([{"params": ps[:2]}, {"params": ps[2:], "use_muon": False}], lr=0.02),
}


def _run(name: str, *, recycle: bool, steps: int = 7, **delay) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = MAKERS[name](params)
    if not recycle:
        opt.recycle = lambda updates: None
    stepper = DelayedOptimizer(opt, **delay) if delay else opt
    for t in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) if t != 3 or p.ndim != 1 else None  # one missed grad
        stepper.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("name", MAKERS)
@pytest.mark.parametrize("delay", [{}, {"delays": 1}, {"delays": 2, "correction": "ef"},
                                   {"delays": 1, "correction": "ef", "ef_beta": 0.5},
                                   {"delays": 2, "correction": "nesterov"}])
def test_recycling_changes_nothing(name, delay):
    ours, plain = _run(name, recycle=True, **delay), _run(name, recycle=False, **delay)
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))


def test_steady_state_step_reuses_its_buffers():
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = bo.Lion(params)
    seen: list[set[int]] = []
    real = opt.compute_updates

    def spy():
        updates = real()
        seen.append({u.data_ptr() for u in updates})
        return updates

    opt.compute_updates = spy
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert seen[1] == seen[2] == seen[0]  # the same memory every step after the first


def test_pool_holds_at_most_one_update_per_parameter():
    params = [nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    opt = bo.Lion(params)
    opt.recycle([torch.empty(4, 4) for _ in range(10)] + [torch.empty(3, 3), None])
    pool = opt._update_pool()
    assert sum(len(b) for _, b in pool.values()) == 3


def test_a_tensor_recycled_twice_is_handed_out_once():
    params = [nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    opt = bo.Lion(params)
    u = torch.empty(4, 4)
    opt.recycle([u, u, u])
    out = opt._out_like(params)
    assert len({x.data_ptr() for x in out}) == 3 and sum(x is u for x in out) == 1


def test_use_foreach_resolves_by_device():
    cpu = [torch.zeros(2)]
    assert bo.base.use_foreach(None, cpu) is False
    assert bo.base.use_foreach(True, cpu) is True
    assert bo.base.use_foreach(False, [torch.zeros(2, device="meta")]) is False
    assert bo.base.use_foreach(None, [torch.zeros(2, device="meta")]) is True


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_ef_rounds_the_same_whether_or_not_it_writes_in_place(beta):
    """Updates that cannot become a parameter's storage (here views into a larger buffer, like a resumed run's
    copies versus a live run's batched results) take the out-of-place path: the bits must not change."""

    def as_views(opt):
        real = opt.compute_updates

        def views():
            return [None if u is None else torch.cat([u.flatten(), u.new_zeros(1)])[:-1].view_as(u) for u in real()]

        opt.compute_updates = views
        return opt

    runs = []
    for wrap in (lambda opt: opt, as_views):
        g = torch.Generator().manual_seed(5)
        params = [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
        delayed = DelayedOptimizer(wrap(bo.AdamW(params, lr=1e-2)), delays=2, correction="ef", ef_beta=beta)
        for _ in range(6):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            delayed.step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
