"""Resume on another layout (docs/training.md): a checkpoint written at one number of stages, of data-parallel
replicas or in one runtime continues at another, its asynchronous state (stashed weight versions, Error
Feedback's ring, Muon's and AdamW's state) moved to the new stages by parameter name.

The runs are 2BW + EF with the smoke preset's model (llama-1m, 4 layers) and Muon, cut to 8 steps of 4 x 32
tokens in 4 microbatches. Gradient clipping is off: each stage clips its own gradients to ``grad_clip /
sqrt(P)``, so a binding clip is itself a function of ``P``; without it 2BW's update does not depend on ``P``
(delay 1 on every stage), the uninterrupted runs at P = 1, 2 and 4 are one trajectory (checked below), and a
resumed run must continue it bit for bit in the simulation. The distributed runtime computes the weights the
simulation computes bit for bit at the same layout (docs/runtime.md); its logged loss sums the microbatch
losses in another order (relative 1e-7), and data-parallel replicas sum gradients in another order too, so
those comparisons take the runtime's tolerance, 1e-5 relative.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bubblefree.config import Config, apply_overrides
from bubblefree.data import load_tokens
from bubblefree.errors import UserError
from bubblefree.models import build_model
from bubblefree.train.checkpoint import load_checkpoint
from bubblefree.train.loop import train
from bubblefree.train.metrics import read_metrics
from bubblefree.train.presets import smoke
from bubblefree.train.sim import SimExecutor

RTOL = 1e-5  # the distributed runtime's tolerance against the simulation (tests/test_distributed.py)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def tiny(cache_dir: str, **overrides: Any) -> Config:
    return apply_overrides(smoke(), {
        "data.cache_dir": cache_dir, "train.steps": 8, "train.seq_len": 32, "train.batch_size": 4,
        "train.eval_batches": 2, "train.eval_every": 4, "train.log_every": 1, "train.ckpt_every": 2,
        "train.ckpt_keep": 10, "train.threads": 1, "train.grad_clip": 0.0, "pipeline.microbatches": 4,
        "log.progress": False, **overrides})


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}.pt"


def _resumable_copy(run: Path, step: int, dst: Path) -> Path:
    """A run folder holding ``run``'s files as they were when it wrote its checkpoint of ``step`` (a run lost
    after it): config.toml, data.json, the metrics lines up to ``step`` and that checkpoint."""
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.toml", dst)
    shutil.copy(run / "data.json", dst)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dst / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= step))
    for suffix in (".pt", ".json"):
        shutil.copy(_checkpoint(run, step).with_suffix(suffix), dst / "checkpoints")
    return dst


NORM_RTOL = 1e-6
"""The logged gradient norm combines the stages' float32 norms, so its last bits depend on how the model is cut
into stages even where every weight is the same (relative 1e-7 measured)."""


def _records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl")}


def _assert_continues(run: Path, reference: Path, steps: range | tuple[int, ...], *,
                      rtol: float = 0.0) -> dict[str, float]:
    """``run`` logged ``steps`` after the lines it had (every step up to the last of ``steps``), with the
    reference's loss, learning rate and validation loss (equal as floats, or within ``rtol``) and gradient norm
    (within NORM_RTOL, or ``rtol`` if larger). Returns the largest relative difference of each (the figures of
    docs/training.md, printed with ``pytest -s``)."""
    got, want = _records(run), _records(reference)
    assert sorted(got) == list(range(1, max(steps) + 1))
    got = {step: record for step, record in got.items() if step in steps}
    worst = dict.fromkeys(("loss", "lr", "val_loss", "grad_norm"), 0.0)
    for step, record in got.items():
        for key in worst:
            tol = max(rtol, NORM_RTOL) if key == "grad_norm" else rtol
            assert (key in record) == (key in want[step]), (step, key)
            if key in record:
                worst[key] = max(worst[key], _rel(record[key], want[step][key]))
                assert worst[key] <= tol, (step, key, record, want[step])
    print(f"{run.name}: largest relative differences {', '.join(f'{k} {v:.1e}' for k, v in worst.items())}")
    return worst


def _weights_rel(run: Path, reference: Path, step: int) -> float:
    """Largest ``|w - w_ref| / |w_ref|`` over the weights of the two runs' checkpoints of ``step``."""
    got, want = (load_checkpoint(_checkpoint(r, step))["executor"]["model"] for r in (run, reference))
    assert got.keys() == want.keys()
    rel = max(float((got[n] - w).norm() / w.norm()) for n, w in want.items())
    print(f"{run.name}: weights at step {step}, largest relative difference {rel:.1e}")
    return rel


def _assert_equal_trees(a: Any, b: Any, where: str = "") -> None:
    """Equal structure, equal tensors (bit for bit), equal plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal_trees(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_trees(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)




@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> dict[str, Path]:
    """The uninterrupted runs at P = 2 (checkpoints every 2 steps), with Muon and with AdamW."""
    root = tmp_path_factory.mktemp("relayout")
    runs = {}
    for optim in ("muon", "adamw"):
        runs[optim] = root / optim
        train(tiny(cache_dir, **{"optim.name": optim}), out_dir=runs[optim])
    return runs


def test_uninterrupted_2bw_runs_are_one_trajectory_at_every_P(reference, tmp_path, cache_dir):
    # The premise of the comparisons below: with clipping off, P does not enter 2BW's update.
    train(tiny(cache_dir, **{"pipeline.stages": 4}), out_dir=tmp_path / "p4")
    _assert_continues(tmp_path / "p4", reference["muon"], range(1, 9))


@pytest.mark.parametrize("optim", ["muon", "adamw"])
@pytest.mark.parametrize("stages", [1, 4])
def test_simulation_resumes_at_another_number_of_stages_bit_for_bit(reference, tmp_path, cache_dir, optim, stages):
    run = _resumable_copy(reference[optim], 4, tmp_path / "run")  # mid-run: a weight version and EF in flight
    state = load_checkpoint(_checkpoint(run, 4))["executor"]
    assert state["layout"] == {"runtime": "sim", "stages": 2, "replicas": 1} and state["optimizer"]["filled"]
    assert all(len(p["stash"]) == 1 and len(p["ef"]) == 1 for p in state["optimizer"]["params"].values())

    train(tiny(cache_dir, **{"optim.name": optim, "pipeline.stages": stages}), out_dir=run, resume=True)

    _assert_continues(run, reference[optim], range(5, 9))
    end = load_checkpoint(_checkpoint(run, 8))["executor"]
    assert end["layout"]["stages"] == stages
    # Every tensor of the state: weights, Muon's momentum, AdamW's moments, the stash and the EF ring.
    want_end = load_checkpoint(_checkpoint(reference[optim], 8))["executor"]
    _assert_equal_trees(end["model"], want_end["model"])
    _assert_equal_trees(end["optimizer"], want_end["optimizer"])


@pytest.mark.slow
def test_simulation_to_distributed_at_four_stages_and_back_to_one(reference, tmp_path, cache_dir):
    from bubblefree.distributed import launch_local

    # Simulation, P = 2 -> distributed, P = 4 (steps 5..8).
    dist_run = _resumable_copy(reference["muon"], 4, tmp_path / "dist")
    launch_local(tiny(cache_dir, **{"pipeline.stages": 4, "pipeline.runtime": "distributed"}), dist_run,
                 resume=True)
    _assert_continues(dist_run, reference["muon"], range(5, 9), rtol=RTOL)
    for step in (6, 8):  # the weights and the whole optimizer state are the simulation's bit for bit
        state = load_checkpoint(_checkpoint(dist_run, step))["executor"]
        want = load_checkpoint(_checkpoint(reference["muon"], step))["executor"]
        assert state["layout"] == {"runtime": "distributed", "stages": 4, "replicas": 1}
        _assert_equal_trees(state["model"], want["model"])
        _assert_equal_trees(state["optimizer"], want["optimizer"])

    # Distributed, P = 4 -> simulation, P = 1 (steps 7..8): the state it wrote continues the trajectory exactly.
    sim_run = _resumable_copy(dist_run, 6, tmp_path / "sim")
    train(tiny(cache_dir, **{"pipeline.stages": 1}), out_dir=sim_run, resume=True)
    _assert_continues(sim_run, reference["muon"], (7, 8))
    _assert_equal_trees(load_checkpoint(_checkpoint(sim_run, 8))["executor"]["model"],
                        load_checkpoint(_checkpoint(reference["muon"], 8))["executor"]["model"])


@pytest.mark.slow
def test_two_replicas_resume_as_one_in_the_simulation(reference, tmp_path, cache_dir):
    from bubblefree.distributed import launch_local

    dp = tmp_path / "dp"
    launch_local(tiny(cache_dir, **{"pipeline.runtime": "distributed"}), dp, nprocs=4)  # P = 2 x R = 2
    state = load_checkpoint(_checkpoint(dp, 4))["executor"]
    assert state["layout"] == {"runtime": "distributed", "stages": 2, "replicas": 2}
    sim_run = _resumable_copy(dp, 4, tmp_path / "sim")
    train(tiny(cache_dir), out_dir=sim_run, resume=True)
    _assert_continues(sim_run, reference["muon"], range(5, 9), rtol=RTOL)
    assert _weights_rel(sim_run, reference["muon"], 8) < RTOL


def _pipedream(cache_dir: str, **overrides: Any) -> Config:
    return tiny(cache_dir, **{"pipeline.schedule": "pipedream", **overrides})


@pytest.mark.slow
def test_pipedream_in_flight_is_refused_at_another_number_of_stages(tmp_path, cache_dir, data_cache):
    # PipeDream's delay is P-1-s: at P = 2 stage 0 holds 1 weight version in flight, at P = 3 it would need 2.
    full = tmp_path / "full"
    train(_pipedream(cache_dir), out_dir=full)
    run = _resumable_copy(full, 4, tmp_path / "run")  # mid-run (the end of a run drains the pipeline)
    with pytest.raises(UserError, match=r"^Invalid --resume: the asynchronous state of pipedream cannot move "
                                        r"from pipeline\.stages = 2 to 3: parameter embed\.weight has delay 1 in "
                                        r"the checkpoint and 2 here"):
        train(_pipedream(cache_dir, **{"pipeline.stages": 3}), out_dir=run, resume=True)
    # The same from the command line: exit 2, one line, nothing written.
    before = sorted(p.name for p in run.rglob("*"))
    result = subprocess.run([sys.executable, "-m", "bubblefree.cli", "train", "--resume", str(run), "--set",
                             "pipeline.stages=3"], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "resume with --set pipeline.stages=2" in result.stderr
    assert sorted(p.name for p in run.rglob("*")) == before


def test_pipedream_resumes_at_another_number_of_stages_from_a_synchronous_phase(tmp_path, cache_dir):
    # At step 4 of a run that starts asynchronous steps at 6 nothing is in flight: the P = 3 run continues as if
    # it had been at P = 3 from the start (the synchronous steps do not depend on P with clipping off).
    sync_start = {"delay.sync_start_steps": 6}
    two, three = tmp_path / "p2", tmp_path / "p3"
    train(_pipedream(cache_dir, **sync_start), out_dir=two)
    train(_pipedream(cache_dir, **sync_start, **{"pipeline.stages": 3}), out_dir=three)
    run = _resumable_copy(two, 4, tmp_path / "run")
    train(_pipedream(cache_dir, **sync_start, **{"pipeline.stages": 3}), out_dir=run, resume=True)
    _assert_continues(run, three, range(5, 9))
    assert _records(two)[8]["loss"] != _records(three)[8]["loss"]  # the delays of P = 3 were used after step 6


def _format_1(path: Path, config: Config, *, distributed: bool) -> None:
    """Rewrite checkpoint ``path`` as bubblefree wrote it before checkpoints were layout-free: the optimizer
    state by position in the simulation's one optimizer, or in the stage's optimizer of a one-stage
    distributed run (the same order: a one-stage split is the whole model), and no manifest."""
    ckpt = load_checkpoint(path)
    data = load_tokens(config.data)
    sim = SimExecutor(config, build_model(config.model.preset, vocab_size=data.vocab_size), data)
    sim.load_state_dict(ckpt["executor"])
    weights, delayed = sim.model.state_dict(), sim.delayed.state_dict()
    ckpt["executor"] = ({"runtime": "distributed", "schedule": "2bw", "stages": [{"module": weights,
                                                                                 "delayed": delayed}]}
                        if distributed else {"model": weights, "optimizer": delayed})
    ckpt["format"] = 1
    torch.save(ckpt, path)
    path.with_suffix(".json").unlink()


@pytest.mark.parametrize("distributed", [False, True])
def test_a_checkpoint_of_format_1_resumes_at_another_layout(reference, tmp_path, cache_dir, distributed):
    run = _resumable_copy(reference["muon"], 4, tmp_path / "run")
    _format_1(_checkpoint(run, 4), tiny(cache_dir), distributed=distributed)
    # Written before manifests existed: its resume accepts it unverified (docs/reliability.md).
    train(tiny(cache_dir, **{"pipeline.stages": 4}), out_dir=run, resume=True, accept_damaged=True)
    _assert_continues(run, reference["muon"], range(5, 9))
