"""DelayedOptimizer and its per-parameter delays against independent float64 recursions of docs/spec.md.

The references below keep the whole history (every ``x_j`` and ``u_j``) in numpy and index it directly, so
they share nothing with the ring buffers, storage swaps and phase switches of the implementation.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
from torch import nn

from bubblefree.delay import DelayedOptimizer, merge_named_states, parameter_delays
from bubblefree.errors import UserError
from bubblefree.optim import AdamW, UpdateOptimizer

# ------------------------------------------------------------------------------ quadratic problem
# f_t(x) = 0.5 x^T A x - c_t^T x over x = [a (3 coords); b (2 coords)], two parameters so delays can differ.
_rng = np.random.default_rng(0)
_Q = np.linalg.qr(_rng.normal(size=(5, 5)))[0]
A = _Q @ np.diag([0.5, 0.8, 1.0, 1.5, 2.0]) @ _Q.T
X0 = _rng.normal(size=5)
SIZES = (3, 2)


def c_t(t: int) -> np.ndarray:
    return np.array([1.0, -0.5, 0.3, 0.2, -1.0]) + 0.3 * np.sin(np.arange(5) + 0.7 * t)


class SGDM(UpdateOptimizer):
    """torch.optim.SGD's rule (momentum, dampening 0, coupled weight decay) as an UpdateOptimizer, for tests."""

    def __init__(self, params, lr, momentum, weight_decay):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def _group_updates(self, group, params, grads):
        out = []
        for p, g in zip(params, grads):
            g = g.add(p, alpha=group["weight_decay"])
            st = self.state[p]
            st["momentum_buffer"] = g.clone() if "momentum_buffer" not in st else st["momentum_buffer"].mul_(
                group["momentum"]).add_(g)
            out.append(st["momentum_buffer"].mul(group["lr"]))
        return out


SGD_HP = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
ADAM_HP = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
OPTIMIZERS = {  # name -> (factory, uses the UpdateOptimizer path)
    "sgdm-plain": (lambda ps: torch.optim.SGD(ps, **SGD_HP), False),
    "sgdm-update": (lambda ps: SGDM(ps, **SGD_HP), True),
    "adamw-plain": (lambda ps: torch.optim.AdamW(ps, **ADAM_HP), False),
    "adamw-update": (lambda ps: AdamW(ps, **ADAM_HP), True),
}
MOMENTUM_FREE = {  # the same without a momentum of their own, for the corrections that are one (update-ema)
    "sgd-update": (lambda ps: SGDM(ps, **{**SGD_HP, "momentum": 0.0}), True),
    "adamw0-update": (lambda ps: AdamW(ps, **{**ADAM_HP, "betas": (0.0, ADAM_HP["betas"][1])}), True),
}


class RefSGDM:
    def __init__(self, momentum: float = SGD_HP["momentum"]):
        self.buf, self.momentum = None, momentum

    def update(self, g, x):
        g = g + SGD_HP["weight_decay"] * x
        self.buf = g.copy() if self.buf is None else self.momentum * self.buf + g
        return SGD_HP["lr"] * self.buf


class RefAdamW:
    def __init__(self, beta1: float = ADAM_HP["betas"][0]):
        self.m = self.v = 0.0
        self.k = 0
        self.beta1 = beta1

    def update(self, g, x):
        lr, (_, b2), eps, wd = ADAM_HP["lr"], ADAM_HP["betas"], ADAM_HP["eps"], ADAM_HP["weight_decay"]
        b1 = self.beta1
        self.k += 1
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        return lr * wd * x + lr * (self.m / (1 - b1**self.k)) / (np.sqrt(self.v / (1 - b2**self.k)) + eps)


def reference(opt, delays, correction, *, T, beta=1.0, lam=0.0, gamma=0.9, ks=0, kc=0, adaptive=False, alpha=1.0):
    """docs/spec.md sections 3, 5, 6 and docs/delay.md (DC-ASGD-a, weight prediction) written out with full
    histories; returns x_1..x_T (y_1..y_T for Nesterov)."""
    inner = RefAdamW() if opt.startswith("adamw") else RefSGDM()
    d = np.repeat(delays, SIZES)
    is_async = lambda t: ks <= t < T - kc  # noqa: E731
    start = next((t for t in range(T) if is_async(t)), None)
    x, w_prev = X0.copy(), X0.copy()  # x: live weights (Nesterov: w, the non-look-ahead iterate)
    live_hist, us, out = {}, {}, []
    mean_square = np.zeros(5)  # DC-ASGD-a's v, updated only where a delayed gradient is compensated
    for t in range(T):
        dt = d if is_async(t) else np.zeros(5, int)
        live = x + gamma * (x - w_prev) if correction == "nesterov" else x  # y_t = w_t + m_t
        live_hist[t] = live.copy()
        src = [max(t - dt[i], start if is_async(t) else t) for i in range(5)]  # j = max(t - d, a)
        stale = np.array([live_hist[src[i]][i] for i in range(5)])
        if correction == "predict":  # x^ = x_j + alpha d (x_j - x_{j-1}), x_{a-1} := x_a
            prev = np.array([live_hist[src[i] - 1][i] if src[i] > start else stale[i] for i in range(5)])
            stale = np.where(dt > 0, stale + alpha * dt * (stale - prev), stale)
        g = A @ stale - c_t(t)
        if correction == "taylor":
            scale = np.full(5, lam)
            if adaptive:
                mean_square = np.where(dt > 0, 0.95 * mean_square + 0.05 * g * g, mean_square)
                scale = lam / np.sqrt(mean_square + 1e-7)
            g = g + scale * g * g * (live - stale)
        u = inner.update(g, live)
        us[t] = u
        if correction == "nesterov":  # w_{t+1} = w_t + gamma (w_t - w_{t-1}) - (1 - gamma) u_t
            x, w_prev = x + gamma * (x - w_prev) - (1 - gamma) * u, x
        elif correction == "ef":
            old = np.array([us[t - dt[i]][i] if t - dt[i] >= (start if dt[i] else t) else 0.0 for i in range(5)])
            x = x - u - beta * (u - old)
        else:
            x = x - u
        if correction == "ef" and is_async(t) and not is_async(t + 1):  # cooldown switch: flush, x <- z
            x = x + beta * np.array([sum(us[j][i] for j in range(max(t + 1 - d[i], start), t + 1))
                                     for i in range(5)])
        out.append(x + gamma * (x - w_prev) if correction == "nesterov" else x.copy())
    return np.array(out)


def run_torch(opt, delays, correction, *, T, beta=1.0, lam=0.0, gamma=0.9, ks=0, kc=0, adaptive=False, alpha=1.0):
    factory, _ = {**OPTIMIZERS, **MOMENTUM_FREE}[opt]
    params = [nn.Parameter(torch.tensor(part)) for part in np.split(X0, np.cumsum(SIZES)[:-1])]
    delayed = DelayedOptimizer(factory(params), delays=list(delays), correction=correction, ef_beta=beta,
                               taylor_lambda=lam, taylor_adaptive=adaptive, ema_beta=gamma,
                               predict_scale=alpha, sync_start_steps=ks, sync_cooldown_steps=kc, total_steps=T)
    a_mat, out = torch.tensor(A), []
    for t in range(T):
        delayed.zero_grad()
        with delayed.stale_params():
            x = torch.cat(params)
            (0.5 * x @ a_mat @ x - torch.tensor(c_t(t)) @ x).backward()
        delayed.step()
        out.append(torch.cat(params).detach().numpy().copy())
    return np.array(out)


CASES = {  # name -> (per-parameter delays, correction, options)
    "delay1": ((1, 1), "none", {}),
    "delay2": ((2, 2), "none", {}),
    "per-param": ((2, 0), "none", {}),
    "ef-beta1": ((1, 1), "ef", dict(beta=1.0)),
    "ef-beta0.5-d2": ((2, 1), "ef", dict(beta=0.5)),
    "taylor": ((1, 2), "taylor", dict(lam=0.5)),
    "sync-start-ef": ((2, 2), "ef", dict(ks=3)),
    "cooldown-ef": ((2, 1), "ef", dict(kc=4)),
    "start-cooldown": ((2, 2), "none", dict(ks=2, kc=3)),
    "taylor-start-cooldown": ((1, 2), "taylor", dict(lam=0.5, ks=2, kc=3)),
    "taylor-adaptive": ((1, 2), "taylor", dict(lam=0.3, adaptive=True)),
    "taylor-adaptive-start-cooldown": ((2, 1), "taylor", dict(lam=0.3, adaptive=True, ks=2, kc=3)),
    "predict-d1": ((1, 1), "predict", {}),
    "predict-per-param": ((2, 0), "predict", dict(alpha=0.5)),
    "predict-d3": ((3, 1), "predict", dict(alpha=2.0)),
    "predict-start-cooldown": ((2, 1), "predict", dict(ks=3, kc=4)),
    "nesterov": ((2, 0), "nesterov", dict(gamma=0.9)),
    "nesterov-start-cooldown": ((1, 1), "nesterov", dict(gamma=0.8, ks=2, kc=3)),
}


@pytest.mark.parametrize("case,opt", [(c, o) for c in CASES for o in OPTIMIZERS  # EF/Nesterov: UpdateOptimizer
                                      if OPTIMIZERS[o][1] or CASES[c][1] in ("none", "taylor", "predict")])
def test_trajectory_matches_reference(case, opt):
    delays, correction, kw = CASES[case]
    got = run_torch(opt, delays, correction, T=15, **kw)
    want = reference(opt, delays, correction, T=15, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    # the delay must matter: the synchronous trajectory is far from this one
    assert np.abs(want - reference(opt, (0, 0), "none", T=15)).max() > 1e-3


@pytest.mark.parametrize("correction,kw", [("predict", dict(alpha=1.0)), ("taylor", dict(lam=0.3, adaptive=True))])
def test_new_corrections_change_the_trajectory(correction, kw):
    """The references above are not vacuous: prediction and DC-ASGD-a move the delayed trajectory."""
    for opt in ("sgdm-update", "adamw-update"):
        plain = reference(opt, (2, 1), "none", T=15)
        assert np.abs(reference(opt, (2, 1), correction, T=15, **kw) - plain).max() > 1e-3


def test_predicted_versions_ahead_are_the_ones_the_step_will_see():
    """A pipeline enters step t+k after only t updates (``stale_tensors(k)``); with prediction the point it gets
    must be the very one step t+k's own ``stale_params()`` holds (delays 2 and 1, the live-weights case k = d)."""
    model = mlp(dtype=torch.float64)
    delayed = DelayedOptimizer(AdamW(model.parameters(), lr=1e-2), delays=[2, 2, 1, 1], correction="predict",
                               predict_scale=1.5, sync_start_steps=1, total_steps=12)
    seen: dict[int, list[torch.Tensor]] = {}
    for t in range(10):
        for k in range(0, 3 if delayed.is_async() else 1):
            k_ok = [min(k, d) for d in delayed.effective_delays()]
            if len(set(k_ok)) == 1:  # every parameter can look k ahead
                seen.setdefault(t + k, []).append([x.clone() for x in delayed.stale_tensors(k)])
        for versions in seen.pop(t, []):
            assert all(torch.equal(a, b) for a, b in zip(versions, delayed.stale_tensors(0))), t
        train(model, delayed, t + 1, start=t)
    assert delayed.memory_bytes()["predict"] == sum(p.numel() * 8 for p in model.parameters())


def test_build_delayed_passes_every_key_of_the_delay_section():
    """No [delay] key can fall through: each one reaches the DelayedOptimizer attribute of the same name."""
    import dataclasses

    from bubblefree.config import DelayConfig
    from bubblefree.delay import build_delayed

    values = dict(correction="taylor", ef_beta=0.5, taylor_lambda=2.0, taylor_adaptive=True, ema_beta=0.9,
                  predict_scale=0.5, sync_start_steps=1, sync_cooldown_steps=2)
    assert set(values) == {f.name for f in dataclasses.fields(DelayConfig)}  # a new key needs a value here
    delayed = build_delayed(AdamW(mlp().parameters()), delays=1, config=DelayConfig(**values), total_steps=10)
    assert {k: getattr(delayed, k) for k in values} == values and delayed.total_steps == 10


def test_nesterov_with_sgd_is_the_paper_rule():
    """Plain SGD inside (u = lr g): w_{t+1} = w_t + m_t - lr (1-gamma) grad f(w_{t-d} + m_{t-d}), in w-form."""
    lr, gamma, T = 0.1, 0.9, 12
    p = nn.Parameter(torch.tensor(X0))
    delayed = DelayedOptimizer(SGDM([p], lr=lr, momentum=0.0, weight_decay=0.0), delays=2,
                               correction="nesterov", ema_beta=gamma)
    w = [X0.copy(), X0.copy()]  # w_{-1}, w_0
    look = lambda k: w[k + 1] + gamma * (w[k + 1] - w[k])  # noqa: E731  (w_k + m_k, k >= 0)
    for t in range(T):
        delayed.zero_grad()
        with delayed.stale_params():
            (0.5 * p @ torch.tensor(A) @ p - torch.tensor(c_t(t)) @ p).backward()
        delayed.step()
        g = A @ look(max(t - 2, 0)) - c_t(t)
        w.append(w[-1] + gamma * (w[-1] - w[-2]) - lr * (1 - gamma) * g)
        np.testing.assert_allclose(p.detach().numpy(), look(t + 1), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------- small networks
def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batch(t, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(6, 4, generator=g, dtype=dtype), torch.randn(6, 3, generator=g, dtype=dtype)


def train(model, delayed, steps, start=0, hook=None):
    for t in range(start, steps):
        x, y = batch(t, next(model.parameters()).dtype)
        delayed.zero_grad()
        with delayed.stale_params():
            ((model(x) - y) ** 2).mean().backward()
        if hook:
            hook(t)
        delayed.step()


@pytest.mark.parametrize("kind", ["adamw-ef", "adamw-taylor", "sgd-plain", "adamw-all-sync"])
def test_delay_zero_is_the_plain_optimizer_bit_for_bit(kind):
    make = (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) if kind == "sgd-plain" else (
        lambda m: AdamW(m.parameters(), lr=1e-2))
    ref, model = mlp(), mlp()
    ref_opt = make(ref)
    kw = dict(delays=0, correction=kind.split("-")[1] if kind.startswith("adamw-") else "none")
    if kind == "adamw-all-sync":  # delays configured but the whole run synchronous
        kw = dict(delays=2, correction="ef", sync_start_steps=20, total_steps=20)
    train(model, DelayedOptimizer(make(model), **kw, taylor_lambda=0.5 if "taylor" in kind else 0.0), 20)
    train(ref, type("Plain", (), {"zero_grad": ref_opt.zero_grad, "step": ref_opt.step,
                                  "stale_params": lambda self: torch.enable_grad()})(), 20)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_ef_invariant_on_a_small_net(beta):
    """z_t = x_t + beta * (sum of the last d updates) obeys z_{t+1} = z_t - u_t (per-parameter delays 2 and 1)."""
    model = mlp()
    opt = AdamW(model.parameters(), lr=1e-2)
    delays = [2, 2, 1, 1]
    recorded = []
    inner = opt.compute_updates
    opt.compute_updates = lambda: [u.clone() for u in (recorded.append(inner()) or recorded[-1])]
    delayed = DelayedOptimizer(opt, delays=delays, correction="ef", ef_beta=beta)
    params = list(model.parameters())
    zs = []

    def z(t):  # z_t from x_t and u_{t-d}..u_{t-1} (u_j = 0 for j < 0)
        return [p.detach().clone() + beta * sum((recorded[j][i] for j in range(max(t - d, 0), t)),
                                                torch.zeros_like(p)) for i, (p, d) in enumerate(zip(params, delays))]

    for t in range(12):
        zs.append(z(t))
        train(model, delayed, t + 1, start=t)
    zs.append(z(12))
    for t in range(12):
        for a, b, u in zip(zs[t + 1], zs[t], recorded[t]):
            torch.testing.assert_close(a, b - u, rtol=0, atol=2e-7)
    assert max(float(u.abs().max()) for u in recorded[5]) > 1e-3  # the invariant is not vacuous


def test_per_stage_delays_touch_only_their_stage():
    """pipedream, P = 2: stage 0 sees x_{t-1}, stage 1 its fresh weights; gradients match a functional call."""
    model = mlp(dtype=torch.float64)
    opt = AdamW(model.parameters(), lr=1e-2)
    stages = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1}
    delays = parameter_delays(model, opt, "pipedream", 2, stages)
    assert delays == [1, 1, 0, 0]
    delayed = DelayedOptimizer(opt, delays=delays)
    names = [n for n, _ in model.named_parameters()]
    history = [{n: p.detach().clone() for n, p in model.named_parameters()}]

    def check(t):
        point = {n: history[max(t - 1, 0)][n] if stages[n] == 0 else history[t][n] for n in names}
        point = {n: v.clone().requires_grad_() for n, v in point.items()}
        x, y = batch(t, torch.float64)
        ((torch.func.functional_call(model, point, (x,)) - y) ** 2).mean().backward()
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, point[n].grad), (t, n)

    for t in range(6):
        train(model, delayed, t + 1, start=t, hook=check)
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert not torch.equal(history[3]["0.weight"], history[2]["0.weight"])


def test_stale_tensors_ahead_and_restore_on_error():
    model = mlp()
    delayed = DelayedOptimizer(AdamW(model.parameters(), lr=1e-2), delays=2)
    snaps = []
    for t in range(4):
        snaps.append([p.detach().clone() for p in model.parameters()])
        train(model, delayed, t + 1, start=t)
    live = list(model.parameters())
    for ahead, want in ((0, snaps[2]), (1, snaps[3])):
        assert all(torch.equal(a, b) for a, b in zip(delayed.stale_tensors(ahead), want))
    assert all(a is b for a, b in zip(delayed.stale_tensors(2), live))
    with pytest.raises(ValueError, match="ahead"):
        delayed.stale_tensors(3)
    before = [p.data_ptr() for p in live]
    with pytest.raises(RuntimeError, match="boom"), delayed.stale_params():
        assert all(torch.equal(p, s) for p, s in zip(live, snaps[2]))
        raise RuntimeError("boom")
    assert [p.data_ptr() for p in live] == before


def test_memory_is_d_versions_and_d_buffers():
    model = mlp()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    delayed = DelayedOptimizer(AdamW(model.parameters(), lr=1e-2), delays=2, correction="ef")
    for t in range(5):
        train(model, delayed, t + 1, start=t)
        assert delayed.memory_bytes() == {"stash": 2 * nbytes, "ef": min(t + 1, 2) * nbytes, "nesterov": 0,
                                          "taylor": 0, "predict": 0}


def test_in_memory_state_dict_round_trip():
    kw = dict(delays=1, correction="ef", total_steps=10)
    full, part = mlp(), mlp()
    train(full, DelayedOptimizer(AdamW(full.parameters(), lr=1e-2), **kw), 10)
    d1 = DelayedOptimizer(AdamW(part.parameters(), lr=1e-2), **kw)
    train(part, d1, 5)
    sd, weights = copy.deepcopy(d1.state_dict()), copy.deepcopy(part.state_dict())
    fresh = mlp(seed=3)
    fresh.load_state_dict(weights)
    d2 = DelayedOptimizer(AdamW(fresh.parameters(), lr=1e-2), **kw)
    d2.load_state_dict(sd)
    train(fresh, d2, 10, start=5)
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), fresh.parameters()))
    with pytest.raises(UserError, match="delays"):
        DelayedOptimizer(AdamW(mlp().parameters()), delays=2, correction="ef").load_state_dict(sd)


class _Parts:
    """Several DelayedOptimizers stepped as one (the stages of a pipeline), for :func:`train`."""

    def __init__(self, parts):
        self.parts = parts

    def zero_grad(self):
        for d in self.parts:
            d.zero_grad()

    @contextlib.contextmanager
    def stale_params(self):
        with contextlib.ExitStack() as stack:
            for d in self.parts:
                stack.enter_context(d.stale_params())
            yield

    def step(self):
        for d in self.parts:
            d.step()


def _assert_same_tree(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def test_named_state_moves_to_another_split_and_merges_back():
    """The whole model's state by name loads into one optimizer per part (a pipeline's stages) in the middle of
    an asynchronous phase (a stashed version and an EF update in flight): the parts step exactly as the whole
    does, and their merged state is the whole's."""
    kw = dict(delays=1, correction="ef", total_steps=10)
    whole_model = mlp()
    whole = DelayedOptimizer(AdamW(whole_model.parameters(), lr=1e-2), **kw)
    train(whole_model, whole, 4)
    names = [n for n, _ in whole_model.named_parameters()]
    state = copy.deepcopy(whole.named_state_dict(names))
    split_model = mlp(seed=3)
    split_model.load_state_dict(whole_model.state_dict())
    parts = [(i, split_model[i]) for i in (0, 2)]
    part_names = [[f"{i}.{n}" for n, _ in part.named_parameters()] for i, part in parts]
    stages = [DelayedOptimizer(AdamW(part.parameters(), lr=1e-2), **kw) for _, part in parts]
    for stage, own in zip(stages, part_names):
        stage.load_named_state_dict(state, own)
    train(whole_model, whole, 10, start=4)
    train(split_model, _Parts(stages), 10, start=4)
    assert all(torch.equal(p, q) for p, q in zip(whole_model.parameters(), split_model.parameters()))
    merged = merge_named_states([stage.named_state_dict(own) for stage, own in zip(stages, part_names)])
    _assert_same_tree(merged, whole.named_state_dict(names))


def test_named_state_refuses_a_delay_changed_in_flight_and_a_missing_parameter():
    model = mlp()
    delayed = DelayedOptimizer(AdamW(model.parameters(), lr=1e-2), delays=1, correction="ef", total_steps=10)
    train(model, delayed, 3)
    names = [n for n, _ in model.named_parameters()]
    state = delayed.named_state_dict(names)
    with pytest.raises(UserError, match=r"parameter 0\.weight has delay 1 in the checkpoint and 2 here \(4 param"):
        DelayedOptimizer(AdamW(mlp().parameters()), delays=2, correction="ef").load_named_state_dict(state, names)
    with pytest.raises(UserError, match="holds no state for parameter 9.weight"):
        DelayedOptimizer(AdamW(mlp().parameters()), delays=1, correction="ef").load_named_state_dict(
            state, ["9.weight", *names[1:]])
    # In a synchronous phase nothing is in flight: another delay is taken up when the next phase fills (here at
    # once: the run is extended past its end, where it drained).
    train(model, delayed, 10, start=3)
    other = DelayedOptimizer(AdamW(mlp().parameters()), delays=2, correction="ef")
    other.load_named_state_dict(delayed.named_state_dict(names), names)
    assert other.step_count == 10 and other.effective_delays() == [2] * 4


# ---------------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize("kwargs,match", [
    (dict(delays=-1), "delays"),
    (dict(delays=[1, 1]), "delays"),
    (dict(delays=1.5), "delays"),
    (dict(correction="magic"), "correction"),
    (dict(ef_beta=1.5), "ef_beta"),
    (dict(ef_beta=-0.1), "ef_beta"),
    (dict(taylor_lambda=-1.0), "taylor_lambda"),
    (dict(ema_beta=1.0), "ema_beta"),
    (dict(correction="taylor"), "taylor_lambda"),  # lambda 0 would be the plain delay, silently
    (dict(taylor_adaptive=1), "taylor_adaptive"),
    (dict(predict_scale=0.0), "predict_scale"),
    (dict(sync_start_steps=-1), "sync_start_steps"),
    (dict(sync_start_steps=11, total_steps=10), "sync_start_steps"),
    (dict(sync_cooldown_steps=11, total_steps=10), "sync_cooldown_steps"),
    (dict(sync_cooldown_steps=2), "sync_cooldown_steps"),
])
def test_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=f"Invalid {match}"):
        DelayedOptimizer(AdamW(mlp().parameters()), **kwargs)


@pytest.mark.parametrize("correction", ["ef", "nesterov"])
def test_corrections_need_an_update_optimizer(correction):
    with pytest.raises(ValueError, match="UpdateOptimizer"):
        DelayedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), delays=1, correction=correction)


# ------------------------------------------------------------------------------ parameter delays
def test_parameter_delays_follows_the_optimizer_order():
    model = mlp()
    stages = {"0.weight": 0, "0.bias": 1, "2.weight": 2, "2.bias": 3}
    opt = torch.optim.SGD([{"params": [model[2].bias, model[0].weight]},
                           {"params": [model[2].weight, model[0].bias]}], lr=0.1)
    assert parameter_delays(model, opt, "wpipe", 2, stages) == [0, 1, 0, 1]
    assert parameter_delays(model, opt, [5, 6, 7, 8], 4, stages) == [8, 5, 7, 6]
    with pytest.raises(ValueError, match="Invalid stage delays"):
        parameter_delays(model, opt, [1, 2, 3], 4, stages)
    with pytest.raises(ValueError, match="Invalid param_stages"):
        parameter_delays(model, opt, "2bw", 2, stages)  # stage 2 and 3 do not exist with P = 2
    with pytest.raises(ValueError, match="Invalid param_stages"):
        parameter_delays(model, opt, "2bw", 2, {"0.weight": 0})
