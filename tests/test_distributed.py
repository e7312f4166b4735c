"""The distributed runtime against the single-process simulation (gloo, CPU), and its failure handling.

Each case spawns the pipeline's processes (tests/distributed_worker.py), runs a few steps of a tiny LLaMA
(d=32, 4 layers, vocab 64) with AdamW and Error Feedback, and compares rank 0's per-step losses and the
final weights of every stage with ``SimExecutor`` on the same seed and data: relative 1e-5 (fp32; the
only differences are summation orders of gradient accumulation and the replica all-reduce).
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from distributed_worker import run, tiny_data, tiny_model, worker  # noqa: E402

from bubblefree.distributed import PipelineFailure, launch_local, one_f_one_b  # noqa: E402
from bubblefree.train.config import Config  # noqa: E402
from bubblefree.train.sim import SimExecutor  # noqa: E402

RTOL = 1e-5


def _config(schedule: str, stages: int, microbatches: int, *, steps: int = 5, sync_start: int = 0) -> Config:
    c = Config()
    c.pipeline.schedule, c.pipeline.stages, c.pipeline.microbatches = schedule, stages, microbatches
    c.train.steps, c.train.batch_size, c.train.seq_len = steps, 2 * microbatches, 16
    c.train.device, c.train.eval_batches = "cpu", 2
    c.optim.name, c.optim.lr = "adamw", 1e-2
    c.delay.correction, c.delay.sync_start_steps = "ef", sync_start
    return c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compare(tmp_path: Path, config: Config, nprocs: int, eval_at: tuple[int, ...] = ()) -> dict[str, float]:
    plan = {"steps": config.train.steps, "eval_at": eval_at}
    mp.start_processes(worker, args=(config, nprocs, _free_port(), str(tmp_path), plan), nprocs=nprocs,
                       start_method="spawn")
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    sim = SimExecutor(config, tiny_model(config.train.seed), tiny_data())
    want = run(sim, config, 0, config.train.steps, eval_at=eval_at)
    want_val = sim.evaluate()
    assert [s for s, *_ in got["losses"]] == list(range(config.train.steps))
    loss_rel = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got["losses"], want))
    norm_rel = max(abs(a[2] - b[2]) / abs(b[2]) for a, b in zip(got["losses"], want))
    reference = sim.model.state_dict()
    names = set()
    weight_rel = 0.0
    for stage in got["state"]["stages"]:
        for name, value in stage["module"].items():
            names.add(name)
            ref = reference[name]
            weight_rel = max(weight_rel, float((value - ref).norm() / ref.norm()))
    assert names == set(reference)
    assert abs(got["val"] - want_val) / want_val < RTOL
    assert loss_rel < RTOL and norm_rel < RTOL and weight_rel < RTOL, (loss_rel, norm_rel, weight_rel)
    return {"loss": loss_rel, "weights": weight_rel}


@pytest.mark.parametrize(("schedule", "stages", "micro", "sync_start", "eval_at"), [
    ("2bw", 2, 2, 0, (2,)),        # delay 1, a drain for evaluation in the middle of the run
    ("pipedream", 3, 2, 0, (2,)),  # per-stage delays 2, 1, 0 and a refill that reads the stash
    ("2bw", 3, 3, 2, ()),          # stock 1F1B for two synchronous steps, then 2BW
    ("gpipe", 2, 2, 0, ()),        # stock GPipe == synchronous training
])
def test_runtime_matches_simulation(tmp_path, schedule, stages, micro, sync_start, eval_at):
    _compare(tmp_path, _config(schedule, stages, micro, sync_start=sync_start), stages, eval_at)


def test_data_x_pipeline_2x2_matches_simulation(tmp_path):
    _compare(tmp_path, _config("2bw", 2, 4), nprocs=4, eval_at=(1,))


def test_one_f_one_b_plan_runs_every_unit_once_in_order():
    for stage in range(4):
        actions = list(one_f_one_b(stage, 4, 6, 14))
        forwards = [u for k, u in actions if k == "F"]
        backwards = [u for k, u in actions if k == "B"]
        assert forwards == backwards == list(range(6, 14))
        # stage s runs P-1-s forwards ahead of its first backward (the 1F1B warmup)
        assert actions.index(("B", 6)) == 4 - stage


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


def test_raising_rank_ends_the_run_with_its_cause(tmp_path, monkeypatch):
    config = _config("1f1b", 2, 2, steps=50)
    config.model.preset, config.data.tokenizer = "llama-1m", "byte"
    config.log.progress = False
    monkeypatch.setenv("BUBBLEFREE_FAULT", "1:2:raise")
    with pytest.raises(PipelineFailure, match="rank 1 failed: RuntimeError: injected fault at step 2"):
        launch_local(config, tmp_path / "run", 2)
