"""Generic tests of the delay corrections, parametrized over the table ``bubblefree.delay.CORRECTIONS``.

A correction added to the table is covered here without a new test: its trajectory against a float64 reference
recursion (it fails until :data:`REFERENCES` has one), its checkpoint round trip through a file at every phase
(synchronous start, asynchronous, cooldown), its memory account, its hyperparameters as config keys, and its
distributed runtime against the simulation (tests/test_distributed.py). The last test re-runs the start of a
committed run and gets its recorded losses bit for bit: moving the corrections into classes changed no number.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bubblefree.config import Config, DelayConfig, OptimConfig, config_from_dict, validate
from bubblefree.delay import CORRECTIONS, DelayedOptimizer, build_delayed
from bubblefree.delay.corrections import HPARAMS
from bubblefree.errors import UserError
from bubblefree.optim import OPTIMIZERS as REGISTRY, AdamW, Adan, Muon, build_optimizer
from test_delay import (
    MOMENTUM_FREE,
    OPTIMIZERS,
    SGD_HP,
    SGDM,
    SIZES,
    X0,
    A,
    RefAdamW,
    RefSGDM,
    c_t,
    mlp,
    reference,
    run_torch,
    train,
)

ROOT = Path(__file__).resolve().parents[1]

# Every correction's knob away from its default, each large enough to move the trajectory.
KNOBS = dict(beta=0.5, lam=0.5, gamma=0.8, alpha=1.5)
HP = dict(ef_beta=0.5, taylor_lambda=0.5, ema_beta=0.8, predict_scale=1.5)


def adamw(params, name: str) -> AdamW:
    """The AdamW the generic tests wrap with correction ``name``: without its momentum (beta1 0) where the
    correction is the momentum (``owns_momentum``; the wrapper refuses it otherwise)."""
    return AdamW(params, lr=1e-2, betas=(0.0, 0.95) if CORRECTIONS[name].owns_momentum else (0.9, 0.95))


def reference_update_ema(opt, delays, *, T, gamma, ks=0, kc=0, bias_correction=True, inner=None, **_):
    """docs/delay.md's update EMA with full histories: ``b_{t+1} = gamma b_t + (1 - gamma) u_t``,
    ``y_{t+1} = y_t - (1 - gamma) u_t - gamma b_{t+1} / (1 - gamma^(t+1))`` (no division without bias correction).
    ``inner``: the inner optimizer's reference (``update(g, x) -> u``); by default ``opt``'s."""
    if inner is None and opt in MOMENTUM_FREE:
        inner = RefAdamW(beta1=0.0) if opt.startswith("adamw") else RefSGDM(momentum=0.0)
    elif inner is None:
        inner = RefAdamW() if opt.startswith("adamw") else RefSGDM()
    d = np.repeat(delays, SIZES)
    is_async = lambda t: ks <= t < T - kc  # noqa: E731
    start = next((t for t in range(T) if is_async(t)), None)
    y, b, hist, out = X0.copy(), np.zeros(5), {}, []
    for t in range(T):
        dt = d if is_async(t) else np.zeros(5, int)
        hist[t] = y.copy()
        stale = np.array([hist[max(t - dt[i], start if is_async(t) else t)][i] for i in range(5)])
        u = inner.update(A @ stale - c_t(t), y)
        b = gamma * b + (1 - gamma) * u
        y = y - (1 - gamma) * u - gamma * b / (1 - gamma ** (t + 1) if bias_correction else 1.0)
        out.append(y.copy())
    return np.array(out)


REFERENCES = {  # name -> float64 reference(opt, delays, *, T, ks, kc, **KNOBS) written from the docs' rule
    "none": lambda opt, delays, **kw: reference(opt, delays, "none", **kw),
    "ef": lambda opt, delays, **kw: reference(opt, delays, "ef", **kw),
    "taylor": lambda opt, delays, **kw: reference(opt, delays, "taylor", **kw),
    "nesterov": lambda opt, delays, **kw: reference(opt, delays, "nesterov", **kw),
    "predict": lambda opt, delays, **kw: reference(opt, delays, "predict", **kw),
    "update-ema": reference_update_ema,
}


def _optimizers(name: str) -> list[str]:
    """The test optimizers a correction runs with: the UpdateOptimizers, and the plain torch ones if it can; the
    momentum-free ones for a correction that is the momentum."""
    table = MOMENTUM_FREE if CORRECTIONS[name].owns_momentum else OPTIMIZERS
    return [o for o, (_, update) in table.items() if update or not CORRECTIONS[name].needs_updates]


@pytest.mark.parametrize("name", CORRECTIONS)
def test_trajectory_matches_a_float64_reference(name):
    assert name in REFERENCES, f"correction {name!r} has no float64 reference in tests/test_corrections.py"
    for opt in _optimizers(name):
        for delays, switches in (((2, 1), dict(ks=2, kc=3)), ((1, 1), {})):
            got = run_torch(opt, delays, name, T=15, **switches, **KNOBS)
            want = REFERENCES[name](opt, delays, T=15, **switches, **KNOBS)
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"{name} {opt} {delays}")
            if name != "none":  # the reference is not the plain delay's: the correction really acts
                assert np.abs(want - reference(opt, delays, "none", T=15, **switches)).max() > 1e-3


def test_update_ema_is_the_uncorrected_one_with_bias_correction():
    """The bias correction makes the first steps full-sized: step 1 moves by u_1 exactly, not (1 - gamma^2) u_1."""
    got = run_torch("sgd-update", (0, 0), "update-ema", T=1, gamma=0.99)
    u1 = RefSGDM(momentum=0.0).update(A @ X0 - c_t(0), X0)
    np.testing.assert_allclose(got[0], X0 - u1, rtol=1e-12)
    plain = reference_update_ema("sgd-update", (0, 0), T=1, gamma=0.99, bias_correction=False)
    np.testing.assert_allclose(plain[0], X0 - (1 - 0.99**2) * u1, rtol=1e-12)
    np.testing.assert_allclose(run_torch("adamw-update", (2, 1), "nesterov", T=12, gamma=0.9),
                               reference_update_ema("adamw-update", (2, 1), T=12, gamma=0.9, bias_correction=False),
                               rtol=1e-10, atol=1e-12)


class RefAdamW0:
    """AdamW with ``beta1 = 0``, what ``optim.momentum = 0`` makes of it (beta2 0.95 and eps 1e-8 its
    defaults): ``u_t = lr wd x_t + lr g_t / (sqrt(v_t / (1 - beta2^t)) + eps)``, ``v_t = beta2 v + (1 - beta2) g^2``."""

    def __init__(self, lr: float, weight_decay: float, beta2: float = 0.95, eps: float = 1e-8):
        self.lr, self.wd, self.beta2, self.eps = lr, weight_decay, beta2, eps
        self.v, self.k = 0.0, 0

    def update(self, g, x):
        self.k += 1
        self.v = self.beta2 * self.v + (1 - self.beta2) * g * g
        return self.lr * self.wd * x + self.lr * g / (np.sqrt(self.v / (1 - self.beta2**self.k)) + self.eps)


def test_update_ema_around_momentum_free_adamw_from_the_config_matches_a_float64_recursion():
    """update-ema as a config runs it: ``optim.momentum = 0`` (which ``validate`` requires) builds AdamW with
    beta1 = 0, ``build_delayed`` wraps it; at delay 1 over 12 steps it is the bias-corrected outer EMA of
    :class:`RefAdamW0`'s updates (float64 both sides, rtol 1e-10: only the order of the float operations
    differs). At the default momentum the two momenta compound and the trajectory moves far from it."""
    T, gamma, lr, wd = 12, 0.8, 0.05, 0.1
    config = Config()
    config.optim.name, config.optim.lr, config.optim.momentum, config.optim.weight_decay = "adamw", lr, 0.0, wd
    config.delay.correction, config.delay.ema_beta = "update-ema", gamma
    validate(config)

    def run(optim: OptimConfig) -> np.ndarray:
        holder = torch.nn.Module()
        holder.a, holder.b = (torch.nn.Parameter(torch.tensor(part)) for part in np.split(X0, np.cumsum(SIZES)[:-1]))
        opt = build_optimizer(holder, optim)
        assert opt.param_groups[0]["betas"] == (optim.momentum if optim.momentum >= 0 else 0.9, 0.95)
        delayed = build_delayed(opt, delays=[1, 1], config=config.delay, total_steps=T)
        out = []
        for t in range(T):
            delayed.zero_grad()
            with delayed.stale_params():
                x = torch.cat([holder.a, holder.b])
                (0.5 * x @ torch.tensor(A) @ x - torch.tensor(c_t(t)) @ x).backward()
            delayed.step()
            out.append(torch.cat([holder.a, holder.b]).detach().numpy().copy())
        return np.array(out)

    got = run(config.optim)
    want = reference_update_ema("adamw", (1, 1), T=T, gamma=gamma, inner=RefAdamW0(lr, wd))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"AdamW has betas\[0\] = 0.9: set it to 0"):  # validate refuses it too
        run(dataclasses.replace(config.optim, momentum=-1.0))


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("momentum", [0.0, 0.5, -1.0])  # -1: the optimizer's default
def test_the_wrapper_refuses_the_update_ema_where_the_config_does(name, momentum):
    """``DelayedOptimizer`` used as a library refuses a correction that is the method's momentum around an
    optimizer that has one, exactly where ``config.validate`` refuses the config (every optimizer of the registry,
    the knob at 0, at 0.5 and at its default), and says what to set."""
    config = Config()
    config.optim.name, config.optim.momentum, config.delay.correction = name, momentum, "update-ema"
    try:
        validate(config)
        refused_by_config = False
    except UserError:
        refused_by_config = True
    model = mlp()
    model.embed = torch.nn.Embedding(4, 3)  # an AdamW group for Muon and MARS: its beta1 0.9 is not the knob's
    opt = build_optimizer(model, config.optim)
    if refused_by_config:
        with pytest.raises(ValueError, match="'update-ema' is the method's momentum.*(set (it|them) to 0|another)"):
            DelayedOptimizer(opt, delays=1, correction="update-ema")
    else:
        DelayedOptimizer(opt, delays=1, correction="update-ema")
    DelayedOptimizer(opt, delays=1, correction="nesterov")  # the first form runs around any momentum


@pytest.mark.parametrize(("make", "match"), [
    (lambda ps: AdamW(ps), r"AdamW has betas\[0\] = 0.9: set it to 0 \(in a config, optim.momentum = 0\)"),
    (lambda ps: Muon(ps), "Muon has momentum = 0.95: set it to 0"),
    (lambda ps: Adan(ps, betas=(0.0, 0.92, 0.99)), "Adan keeps one at any setting .*: choose another one"),
    (lambda ps: SGDM(ps, **SGD_HP), "SGDM has momentum = 0.9"),  # outside the registry: torch's names
])
def test_the_refusal_names_the_momentum_and_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        DelayedOptimizer(make([torch.nn.Parameter(torch.ones(2, 2))]), delays=1, correction="update-ema")


@pytest.mark.parametrize("name", CORRECTIONS)
@pytest.mark.parametrize("save_at", [1, 8, 13])  # synchronous start, asynchronous, cooldown
def test_checkpoint_round_trip(tmp_path, name, save_at):
    kw = dict(delays=[2, 2, 1, 0], correction=name, sync_start_steps=3, sync_cooldown_steps=4, total_steps=16,
              taylor_adaptive=True, **HP)
    full = mlp()
    train(full, DelayedOptimizer(adamw(full.parameters(), name), **kw), 16)
    first = mlp()
    delayed = DelayedOptimizer(adamw(first.parameters(), name), **kw)
    train(first, delayed, save_at)
    torch.save({"model": first.state_dict(), "opt": delayed.state_dict()}, tmp_path / "ckpt.pt")
    train(first, delayed, 16, start=save_at)  # keeps running: the saved file must not be affected
    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed = mlp(seed=1)
    resumed.load_state_dict(ckpt["model"])
    again = DelayedOptimizer(adamw(resumed.parameters(), name), **kw)
    again.load_state_dict(ckpt["opt"])
    assert again.step_count == save_at
    train(resumed, again, 16, start=save_at)
    for p, q, r in zip(full.parameters(), resumed.parameters(), first.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)


def _held(entries: list) -> dict:
    return {i: x for i, x in enumerate(entries) if x is not None}


FIRST_FORMAT = {  # name -> the correction's state as its own hand-written state_dict gave it, read from its attributes
    "none": lambda c: {},
    "ef": lambda c: {"ef": {i: list(ring) for i, ring in enumerate(c.rings) if ring is not None}},
    "taylor": lambda c: {"mean_square": _held(c.mean_square)},
    "nesterov": lambda c: {"momentum": _held(c.momentum)},
    "update-ema": lambda c: {"momentum": _held(c.momentum), "momentum_count": dict(enumerate(c.count))},
    "predict": lambda c: {"change": _held(c.change)},
}
"""Before the corrections declared their buffers (``Correction.buffers``), each wrote its ``state_dict`` and
``load_state_dict`` by hand; checkpoints of that code hold these."""


def _by_identity(tree):
    """``tree`` with each tensor replaced by its identity: equal trees hold the very same tensors in the same places."""
    if isinstance(tree, torch.Tensor):
        return ("tensor", id(tree))
    if isinstance(tree, dict):
        return {k: _by_identity(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, [_by_identity(v) for v in tree])
    return tree


@pytest.mark.parametrize("name", CORRECTIONS)
def test_checkpoints_of_the_hand_written_state_dicts_resume_bit_for_bit(tmp_path, name):
    """The declared buffers save exactly what the hand-written state dicts saved (same keys, parameters, slots
    and tensors), and a checkpoint whose correction state is written in that first form, through a file, loads
    in the asynchronous phase and resumes bit for bit (the run then drains at its cooldown)."""
    kw = dict(delays=[2, 2, 1, 0], correction=name, sync_cooldown_steps=3, total_steps=12, taylor_adaptive=True, **HP)
    full = mlp()
    train(full, DelayedOptimizer(adamw(full.parameters(), name), **kw), 12)
    first = mlp()
    delayed = DelayedOptimizer(adamw(first.parameters(), name), **kw)
    train(first, delayed, 6)
    state, old = delayed.state_dict(), FIRST_FORMAT[name](delayed.corrector)
    assert set(state) == {"inner", "step", "filled", "delays", "correction", "stash", *old}
    assert _by_identity({k: state[k] for k in old}) == _by_identity(old)
    assert name == "none" or _tensors(old), "nothing held: the check would be vacuous"
    torch.save({"model": first.state_dict(), "opt": {**state, **old}}, tmp_path / "first-form.pt")
    ckpt = torch.load(tmp_path / "first-form.pt")
    resumed = mlp(seed=1)
    resumed.load_state_dict(ckpt["model"])
    again = DelayedOptimizer(adamw(resumed.parameters(), name), **kw)
    again.load_state_dict(ckpt["opt"])
    train(resumed, again, 12, start=6)
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    return [t for x in tree for t in _tensors(x)] if isinstance(tree, (list, tuple)) else []


@pytest.mark.parametrize("name", CORRECTIONS)
def test_memory_account_is_the_checkpointed_buffers(name):
    """What ``memory_bytes`` reports for a correction is exactly the tensors its checkpoint holds (no buffer
    left out of either), during the asynchronous phase and after the drain."""
    model = mlp()
    delayed = DelayedOptimizer(adamw(model.parameters(), name), delays=2, correction=name, taylor_adaptive=True,
                               sync_cooldown_steps=2, total_steps=8, **HP)
    key = CORRECTIONS[name].memory_key
    for t in range(8):
        train(model, delayed, t + 1, start=t)
        own = {x.data_ptr(): x for x in _tensors(delayed.corrector.state_dict())}
        held = sum(x.numel() * x.element_size() for x in own.values())
        memory = delayed.memory_bytes()
        assert memory.get(key, 0) == held and sum(memory.values()) == memory["stash"] + held
        assert (memory["stash"] > 0) == delayed.is_async()


@pytest.mark.parametrize("name", CORRECTIONS)
def test_named_state_moves_every_buffer(name):
    """The checkpoint keyed by parameter name (the form that resumes at another layout) carries every buffer of
    the correction: its state keys are the declared buffers' keys, each per parameter, and the named state
    loaded into a fresh wrapper gives the same state back."""
    model, names = mlp(), None
    delayed = DelayedOptimizer(adamw(model.parameters(), name), delays=2, correction=name, taylor_adaptive=True,
                               total_steps=8, **HP)
    for t in range(4):
        train(model, delayed, t + 1, start=t)
    state = delayed.corrector.state_dict()
    assert set(state) == {b.key for b in CORRECTIONS[name].buffers}
    assert all(isinstance(v, dict) and set(v) <= set(range(len(delayed.params))) for v in state.values())
    names = [f"p{i}" for i in range(len(delayed.params))]
    fresh = DelayedOptimizer(adamw(mlp().parameters(), name), delays=2, correction=name, taylor_adaptive=True,
                             total_steps=8, **HP)
    fresh.load_named_state_dict(delayed.named_state_dict(names), names)
    again = fresh.corrector.state_dict()
    for key, per_param in state.items():
        assert set(again[key]) == set(per_param)
        for i, value in per_param.items():
            got = again[key][i]
            same = [torch.equal(a, b) for a, b in zip(_tensors(value), _tensors(got), strict=True)] \
                if _tensors(value) else [value == got]
            assert all(same), (key, i)


@pytest.mark.parametrize("name", CORRECTIONS)
def test_hyperparameters_are_delay_config_keys(name):
    fields = {f.name: f.default for f in dataclasses.fields(DelayConfig)}
    assert all(fields[k] == v for k, v in CORRECTIONS[name].hparams.items())
    assert set(HPARAMS) == set(fields) - {"correction", "sync_start_steps", "sync_cooldown_steps"}


def _committed_run() -> dict:
    return json.loads((ROOT / "results/long/runs/adamw-2bw2-ef-s0-2bce58397f.json").read_text())


@pytest.mark.slow
def test_committed_run_reproduces_its_losses(tmp_path, data_cache):
    """The first 10 steps of a committed AdamW + EF run (2BW, byte-0.5m; the run is 60 steps, so the learning
    rate schedule is the same) give the train and validation losses its JSON records at step 10: bit for bit on
    the kind of machine that made it (its JSON's ``machine``), and within a relative 1e-6 on another CPU, whose
    float32 kernels may sum in another order (an AMD EPYC gave the validation loss 6.8e-8 apart, the train loss
    equal)."""
    from bubblefree.experiments.runner import machine
    from bubblefree.train.loop import Interrupted, train as train_run
    from bubblefree.train.metrics import read_metrics

    record = _committed_run()
    config = config_from_dict(record["config"])

    class StopAt10:
        def should_stop(self, done, signalled):
            return done == 10

        def finished(self):
            pass

    with pytest.raises(Interrupted):
        train_run(config, out_dir=tmp_path / "run", stop=StopAt10())
    step10 = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] == 10]
    rel = 0.0 if record["machine"] == machine() else 1e-6
    for got, want in ((step10[0]["loss"], record["train_curve"][0]), (step10[0]["val_loss"], record["val_curve"][0])):
        assert [10, step10[0]["tokens"]] == want[:2] and got == pytest.approx(want[2], rel=rel, abs=0.0), (got, want)
