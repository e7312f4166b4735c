"""The distributed runtime against the single-process simulation (gloo, CPU), its run folder, and its failures.

Each equivalence case spawns the pipeline's processes (tests/distributed_worker.py), runs a few steps of a tiny
LLaMA (d=32, 4 layers, vocab 64; a 4-expert MoE in two cases) with AdamW and Error Feedback, and compares the
writer's per-step loss, gradient norm, MoE balancing loss and learning rate, the validation loss and the final
weights of every stage with ``SimExecutor`` on the same seed and data: relative 1e-5 (fp32; the only
differences are summation orders of gradient accumulation and the replica all-reduce). Cases with
``resume_at`` also checkpoint there and resume fresh executors from the file, which must continue the same
trajectory. Every rank's trace is checked too.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).parent))
from bubblefree.config import MOMENTUM_CORRECTIONS, Config
from bubblefree.delay import CORRECTIONS, DelayedOptimizer
from bubblefree.distributed import PipelineFailure, launch_local
from bubblefree.distributed.stage import StageRuntime
from bubblefree.optim import AdamW
from bubblefree.schedules.ir import one_f_one_b_order
from bubblefree.train.loop import train
from bubblefree.train.metrics import read_metrics
from bubblefree.train.presets import load_config
from bubblefree.train.sim import SimExecutor
from distributed_worker import run, tiny_data, tiny_model, worker

RTOL = 1e-5


def _config(schedule: str, stages: int, microbatches: int, *, steps: int = 5, sync_start: int = 0,
            correction: str = "ef", cooldown: int = 0) -> Config:
    c = Config()
    c.pipeline.schedule, c.pipeline.stages, c.pipeline.microbatches = schedule, stages, microbatches
    c.train.steps, c.train.batch_size, c.train.seq_len = steps, 2 * microbatches, 16
    c.train.device, c.train.eval_batches = "cpu", 2
    c.optim.name, c.optim.lr = "adamw", 1e-2
    if correction in MOMENTUM_CORRECTIONS:  # the correction is the momentum: the optimizer runs without its own
        c.optim.momentum = 0.0
    c.delay.correction, c.delay.sync_start_steps, c.delay.sync_cooldown_steps = correction, sync_start, cooldown
    # each correction's knob away from its default and large enough to move the trajectory (lambda: DC-ASGD-a)
    c.delay.taylor_lambda, c.delay.taylor_adaptive = 1.0, correction == "taylor"
    c.delay.ema_beta, c.delay.predict_scale, c.delay.ef_beta = 0.8, 1.5, 0.75
    return c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def _stats_rel(got: list, want: list) -> float:
    """Largest relative difference of loss, gradient norm, balancing loss and lr over the steps."""
    assert [row[0] for row in got] == [row[0] for row in want]
    return max(_rel(a, b) for g, w in zip(got, want) for a, b in zip(g[1:], w[1:]))


def _weights_rel(state: dict, reference: dict) -> float:
    """Largest ``|w - w_ref| / |w_ref|`` over the whole model's tensors; every weight must be present."""
    got = state["model"]
    assert set(got) == set(reference)
    return max(float((got[n] - ref).norm() / ref.norm()) for n, ref in reference.items())


def _check_traces(run_dir: Path, nprocs: int) -> None:
    """Every rank wrote trace/rank<r>.jsonl with forwards, backwards and updates, each ending after it starts."""
    for rank in range(nprocs):
        records = [json.loads(line) for line in (run_dir / "trace" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert {"F", "B", "U"} <= {r["kind"] for r in records}, rank
        assert all(r["rank"] == rank and r["start"] < r["end"] for r in records), rank


def _compare(tmp_path: Path, config: Config, nprocs: int, eval_at: tuple[int, ...] = (), *,
             resume_at: int | None = None, n_experts: int = 0) -> dict[str, float]:
    plan = {"steps": config.train.steps, "eval_at": eval_at, "resume_at": resume_at, "n_experts": n_experts}
    mp.start_processes(worker, args=(config, nprocs, _free_port(), str(tmp_path), plan), nprocs=nprocs,
                       start_method="spawn")
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    sim = SimExecutor(config, tiny_model(config.train.seed, n_experts=n_experts), tiny_data())
    want = run(sim, config, 0, config.train.steps, eval_at=eval_at)
    if n_experts:
        assert all(row[3] > 0.5 for row in want)  # the balancing loss is ~1 and is compared below
    reference = sim.model.state_dict()
    rel = {"stats": _stats_rel(got["losses"], want), "weights": _weights_rel(got["state"], reference),
           "val": _rel(got["val"], sim.evaluate())}
    if resume_at is not None:
        rel["resumed stats"] = _stats_rel(got["resumed"]["losses"], want[resume_at:])
        rel["resumed weights"] = _weights_rel(got["resumed"]["state"], reference)
    _check_traces(tmp_path, nprocs)
    print(f"relative differences: {rel}")  # the figures of docs/runtime.md (pytest -s)
    assert all(v < RTOL for v in rel.values()), rel
    return rel


@pytest.mark.parametrize("delay", [1, 2])
@pytest.mark.parametrize(("make", "correction"), [
    *((lambda ps, c=c: AdamW(ps, lr=0.1, betas=(0.0 if CORRECTIONS[c].owns_momentum else 0.9, 0.95)), c)
      for c in CORRECTIONS), (lambda ps: torch.optim.SGD(ps, lr=0.1), "none")],
    ids=[*(f"adamw-{c}" for c in CORRECTIONS), "torch-sgd-none"])
def test_steps_under_way_compute_on_the_stash_itself_and_keep_their_versions(delay, make, correction):
    """A stage of delay ``d`` with the pipeline full, as the asynchronous loop runs it: step ``t + d`` is entered
    before update ``t`` (``d + 1`` steps under way). With an UpdateOptimizer every step's weights are views of the
    stash or the live weights (checked without a correction: prediction makes fresh weights), so the stage holds
    ``1 + d`` weight versions however many steps are in flight; with a plain torch optimizer, which steps the live
    weights in place, the live version is a copy. With every correction of the table, a step's weights still
    hold, when it ends, the values it entered with (after the updates in between moved and rewrote storages), and
    its gradient is the one at them (against ``functional_call`` on a copy, exactly)."""
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    delayed = DelayedOptimizer(make(list(module.parameters())), delays=delay, correction=correction,
                               taylor_lambda=0.5)
    stage = StageRuntime(module, delayed, n_stages=1, grad_clip=0.0)
    x = torch.randn(5, 3)
    entered: dict[int, dict[str, torch.Tensor]] = {}

    def enter(step: int) -> None:
        stage.enter(step)
        versions = stage._versions[step]
        entered[step] = {n: v.detach().clone() for n, v in versions.items()}
        held = {t.data_ptr() for t in [*stage.params, *(x for ring in delayed.stash for x in ring or [])]}
        views = [v.data_ptr() in held for v in versions.values()]
        live = step - stage.updates_done == delay  # ahead = d: the live weights
        if correction == "none":
            assert all(views) if delayed.stale_until_used or not live else not any(views), (step, views)

    for step in range(delay + 1):
        enter(step)
    for step in range(6):
        stage.forward(step, x).square().sum().backward()
        want = {n: t.clone().requires_grad_() for n, t in entered[step].items()}
        functional_call(module, want, (x,)).square().sum().backward()
        for n, v in stage._versions[step].items():
            assert torch.equal(v.detach(), entered[step][n]) and torch.equal(v.grad, want[n].grad), (step, n)
        stage.prepare_update(step, 1.0)
        stage.update(step)
        enter(step + delay + 1)
    assert delayed.stale_until_used == isinstance(delayed.optimizer, AdamW)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "stages", "micro", "sync_start", "eval_at", "resume_at", "experts"), [
    # delays 2, 1, 0; drains for evaluation and checkpoint whose refills read the stash; MoE; resume
    ("pipedream", 3, 2, 0, (1,), 3, 4),
    # stock GPipe == synchronous training; MoE on the stock path
    ("gpipe", 2, 2, 0, (), None, 4),
    # P = 4: stock 1F1B for two synchronous steps, then 2BW (delay 1), an evaluation drain, resume in 2BW
    ("2bw", 4, 4, 2, (2,), 3, 0),
])
def test_runtime_matches_simulation(tmp_path, schedule, stages, micro, sync_start, eval_at, resume_at, experts):
    _compare(tmp_path, _config(schedule, stages, micro, sync_start=sync_start), stages, eval_at,
             resume_at=resume_at, n_experts=experts)


@pytest.mark.slow
@pytest.mark.parametrize(("correction", "schedule", "stages", "micro", "sync_start", "cooldown"), [
    # every correction at P = 2 (2BW, delay 1) and P = 3 (PipeDream, delays 2, 1, 0: stashed and live-weight
    # versions), each with a synchronous start or cooldown at one of the two depths
    ("none", "2bw", 2, 2, 2, 0), ("none", "pipedream", 3, 2, 0, 2),
    ("ef", "2bw", 2, 2, 0, 2), ("ef", "pipedream", 3, 2, 1, 0),
    ("taylor", "2bw", 2, 2, 1, 0), ("taylor", "pipedream", 3, 2, 0, 2),
    ("nesterov", "2bw", 2, 2, 0, 2), ("nesterov", "pipedream", 3, 2, 1, 0),
    ("predict", "2bw", 2, 2, 0, 2), ("predict", "pipedream", 3, 2, 1, 0),
])
def test_every_correction_on_the_runtime_matches_simulation(tmp_path, correction, schedule, stages, micro,
                                                            sync_start, cooldown):
    config = _config(schedule, stages, micro, steps=6, correction=correction, sync_start=sync_start,
                     cooldown=cooldown)
    _compare(tmp_path, config, stages)
    if correction != "none":  # the correction moves the weights far beyond the tolerance: it was really run
        sims = [SimExecutor(c, tiny_model(c.train.seed), tiny_data()) for c in (config, _config(
            schedule, stages, micro, steps=6, correction="none", sync_start=sync_start, cooldown=cooldown))]
        for sim in sims:
            run(sim, config, 0, config.train.steps)
        assert _weights_rel({"model": sims[0].model.state_dict()}, sims[1].model.state_dict()) \
            > 100 * RTOL


@pytest.mark.slow
@pytest.mark.parametrize("correction", [c for c in CORRECTIONS if c not in ("none", "ef", "taylor", "nesterov",
                                                                            "predict")])
def test_corrections_added_to_the_table_match_simulation_on_the_runtime(tmp_path, correction):
    """Every other correction of ``bubblefree.delay.CORRECTIONS`` (the five above have their own cases), at 2BW
    with a cooldown and at PipeDream with a synchronous start: a correction added to the table is covered here."""
    for schedule, stages, sync_start, cooldown in (("2bw", 2, 0, 2), ("pipedream", 3, 1, 0)):
        config = _config(schedule, stages, 2, steps=6, correction=correction, sync_start=sync_start,
                         cooldown=cooldown)
        (tmp_path / schedule).mkdir()
        _compare(tmp_path / schedule, config, stages)


@pytest.mark.slow
def test_cooldown_flush_on_the_runtime_gives_the_simulation_weights(tmp_path):
    """EF's pending corrections are flushed (x <- z) where the cooldown drains the pipeline, on every stage
    locally: the runtime's weights after the run are the simulation's, and the flush is far above the tolerance."""
    config = _config("pipedream", 3, 2, steps=6, cooldown=3)
    config.delay.ef_beta = 1.0
    sim = SimExecutor(config, tiny_model(config.train.seed), tiny_data())
    run(sim, config, 0, 2)  # the last asynchronous step is 2: the flush comes at its end
    pending = [sum(u.double() for u in ring if u is not None) for ring in sim.delayed._ef if ring]
    flush = math.sqrt(sum(float(x.norm()) ** 2 for x in pending))
    weights = math.sqrt(sum(float(p.detach().double().norm()) ** 2 for p in sim.model.parameters()))
    assert flush / weights > 100 * RTOL
    rel = _compare(tmp_path, config, 3)
    assert rel["weights"] < RTOL


@pytest.mark.slow
def test_data_x_pipeline_2x2_matches_simulation(tmp_path):
    _compare(tmp_path, _config("2bw", 2, 4), nprocs=4, eval_at=(1,))


def test_one_f_one_b_order_runs_every_unit_once_in_order():
    """The runtime runs segments of the IR's 1F1B order that start at any unit (after a drain)."""
    for stage in range(4):
        actions = [(a.kind, a.microbatch) for a in one_f_one_b_order(stage, 4, range(6, 14))]
        forwards = [u for k, u in actions if k == "F"]
        backwards = [u for k, u in actions if k == "B"]
        assert forwards == backwards == list(range(6, 14))
        # stage s runs P-1-s forwards ahead of its first backward (the 1F1B warmup)
        assert actions.index(("B", 6)) == 4 - stage


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_forwards_done_is_the_closed_form_of_the_order(P):
    """What drains and receives posted ahead rely on: forwards a stage has run when a backward ends."""
    from bubblefree.distributed.async_loop import forwards_done

    for stage in range(P):
        for segment in [(0, 1), (3, 5), (6, 14), (10, 10 + 3 * P)]:
            order = one_f_one_b_order(stage, P, range(*segment))
            for i, action in enumerate(order):
                if action.kind == "B":
                    ran = sum(a.kind == "F" for a in order[: i + 1])
                    assert forwards_done(stage, P, segment, action.microbatch) == ran, (stage, segment, action)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bubblefree.cli", "train", *args], capture_output=True, text=True,
                          timeout=300, check=False)


SMOKE = ["--preset", "smoke", "--set", "pipeline.stages=2", "--set", "train.eval_every=2", "--set",
         "train.ckpt_every=2", "--set", "train.log_every=1", "--set", "log.progress=false"]


@pytest.mark.slow
def test_cli_runs_the_distributed_runtime_and_resumes_it(tmp_path):
    out = tmp_path / "run"
    first = _cli(*SMOKE, "--set", "pipeline.runtime=distributed", "--set", "train.steps=3", "--out", str(out))
    assert first.returncode == 0, first.stderr
    assert (out / "checkpoints" / "step_00000003.pt").is_file() and (out / "loss.png").is_file()
    resumed = _cli("--resume", str(out), "--set", "train.steps=5")
    assert resumed.returncode == 0, resumed.stderr
    assert (out / "config.toml").is_file() and (out / "checkpoints" / "step_00000005.pt").is_file()
    _check_traces(out, 2)
    # The same two runs in the simulation, in this process: the logs must match step for step.
    overrides = [s for s in SMOKE[2:] if s != "--set"]
    train(load_config("smoke", None, [*overrides, "train.steps=3"]), out_dir=tmp_path / "sim")
    train(load_config("smoke", None, [*overrides, "train.steps=5"]), out_dir=tmp_path / "sim", resume=True)
    got, want = read_metrics(out / "metrics.jsonl"), read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["lr"]) and r["lr"] > 0 for r in got)
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", "lr", "val_loss"):
            assert (key in g) == (key in w), key
            assert key not in w or _rel(g[key], w[key]) < RTOL, (g, w)


@pytest.mark.slow
def test_cli_reports_a_user_error_inside_the_ranks_in_one_line(tmp_path):
    result = _cli(*SMOKE, "--set", "pipeline.runtime=distributed", "--set", "pipeline.schedule=wpipe",
                  "--out", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("bubblefree: error: Invalid pipeline.schedule")
    assert "two partitions per process" in result.stderr  # it says why


@pytest.mark.slow
def test_killed_rank_ends_the_run_naming_it(tmp_path, monkeypatch):
    config = _config("2bw", 2, 2, steps=50)
    config.model.preset, config.data.tokenizer = "llama-1m", "byte"
    config.log.progress = False
    monkeypatch.setenv("BUBBLEFREE_FAULT", "1:3:kill")
    monkeypatch.setenv("BUBBLEFREE_P2P_TIMEOUT", "60")
    tic = time.monotonic()
    with pytest.raises(PipelineFailure, match="rank 1"):
        launch_local(config, tmp_path / "run", 2)
    assert time.monotonic() - tic < 60 + 60  # spawn, imports and data loading included


@pytest.mark.slow
def test_raising_rank_ends_the_run_with_its_cause(tmp_path, monkeypatch):
    config = _config("1f1b", 2, 2, steps=50)
    config.model.preset, config.data.tokenizer = "llama-1m", "byte"
    config.log.progress = False
    monkeypatch.setenv("BUBBLEFREE_FAULT", "1:2:raise")
    with pytest.raises(PipelineFailure, match="rank 1 failed: RuntimeError: injected fault at step 2"):
        launch_local(config, tmp_path / "run", 2)


def test_backend_is_nccl_on_one_gpu_per_local_rank_and_gloo_on_cpu():
    from bubblefree.distributed.mesh import backend_for
    from bubblefree.errors import UserError

    assert backend_for("cpu", local_rank=3, cuda_devices=0) == ("gloo", torch.device("cpu"))
    assert backend_for("cuda", local_rank=3, cuda_devices=8) == ("nccl", torch.device("cuda", 3))
    with pytest.raises(UserError, match="local rank 1 has no GPU of its own .1 visible.; NCCL needs one GPU per rank"):
        backend_for("cuda", local_rank=1, cuda_devices=1)
