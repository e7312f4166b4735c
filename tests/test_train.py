"""The training loop and the single-process executor: exact resume, the LR schedule the loop applies, the
synchronous one-stage step against a hand-written reference step, and every optimizer training."""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch

from bubblefree.config import Config, apply_overrides
from bubblefree.data import get_batch, load_tokens
from bubblefree.models import build_model
from bubblefree.optim import OPTIMIZERS, build_optimizer, set_lr_scale
from bubblefree.train.checkpoint import list_checkpoints, load_checkpoint
from bubblefree.train.loop import train
from bubblefree.train.metrics import read_metrics
from bubblefree.train.presets import smoke
from bubblefree.train.sim import SimExecutor


def tiny(cache_dir: str, **overrides) -> Config:
    """The smoke preset shrunk to a few seconds: byte tokens, llama-1m, 4 x 32 tokens per step."""
    return apply_overrides(smoke(), {
        "data.cache_dir": cache_dir, "train.steps": 12, "train.seq_len": 32, "train.batch_size": 4,
        "train.eval_batches": 2, "train.eval_every": 0, "train.log_every": 1, "train.ckpt_every": 5,
        "train.ckpt_keep": 10, "train.threads": 1, "log.progress": False, **overrides})



@pytest.fixture(scope="module")
def data(cache_dir):
    return load_tokens(tiny(cache_dir).data)


def _without_timing(records):
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


@pytest.mark.parametrize("schedule, correction", [("2bw", "ef"), ("pipedream", "taylor")])
def test_resume_from_a_checkpoint_is_bit_exact(tmp_path, cache_dir, schedule, correction):
    # Delay state (stash, EF buffers) is in flight at step 5, so a resume that lost any of it would diverge.
    overrides = {"pipeline.schedule": schedule, "delay.correction": correction, "pipeline.stages": 3,
                 "delay.taylor_lambda": 0.5, "train.eval_every": 6}
    config = tiny(cache_dir, **overrides)
    full, part = tmp_path / "full", tmp_path / "part"
    train(config, out_dir=full)
    part.mkdir()
    for name in ("config.toml", "data.json"):
        shutil.copy(full / name, part / name)
    (part / "checkpoints").mkdir()
    for name in ("step_00000005.pt", "step_00000005.json"):
        shutil.copy(full / "checkpoints" / name, part / "checkpoints")
    # A run killed at step 7: metrics up to 7, the newest checkpoint at 5.
    (part / "metrics.jsonl").write_text("".join(
        line + "\n" for line in (full / "metrics.jsonl").read_text().splitlines()[:7]))

    train(config, out_dir=part, resume=True)

    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 13))
    assert _without_timing(a) == _without_timing(b)  # losses, norms, lr, val losses: equal as floats
    end_a = load_checkpoint(full / "checkpoints" / "step_00000012.pt")["executor"]
    end_b = load_checkpoint(part / "checkpoints" / "step_00000012.pt")["executor"]
    for name, tensor in end_a["model"].items():
        assert torch.equal(tensor, end_b["model"][name]), name


def test_loop_logs_the_paper_lr_schedule_and_keeps_checkpoints(tmp_path, cache_dir):
    # Hand-derived from the recipe: 12 steps, warmup ceil(0.1 * 12) = 2 steps reaching the peak at step 2,
    # then a cosine over the remaining 9 intervals down to 10 % of the peak at the last step.
    train(tiny(cache_dir, **{"optim.name": "adamw", "optim.lr": 0.004, "train.ckpt_keep": 2}), out_dir=tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    expected = [0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * k / 9)) for k in range(10)]
    assert [r["lr"] for r in records] == pytest.approx([0.004 * e for e in expected], rel=1e-12)
    for r in records:
        assert {"step", "tokens", "loss", "lr", "tokens_per_s", "grad_norm"} <= r.keys()
        assert r["tokens"] == r["step"] * 4 * 32 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0
    assert "val_loss" in records[-1] and "val_loss" not in records[0]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [10, 12]  # ckpt_keep = 2
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sync_one_stage_step_equals_a_plain_training_step(cache_dir, data):
    """P = 1, no delay: accumulate microbatch gradients, global clip_grad_norm_, optimizer step."""
    config = tiny(cache_dir, **{"pipeline.schedule": "sync", "pipeline.stages": 1, "delay.correction": "none",
                                "optim.name": "adamw", "train.grad_clip": 0.05})
    torch.manual_seed(0)
    model = build_model("llama-1m", vocab_size=data.vocab_size)
    reference = copy.deepcopy(model)
    executor = SimExecutor(config, model, data)
    ref_opt = build_optimizer(reference, config.optim)
    for step, scale in enumerate([0.5, 1.0, 0.7]):
        stats = executor.train_step(step, scale)
        ref_opt.zero_grad()
        losses = []
        for micro in range(2):
            x, y = get_batch(data.train, seed=0, step=step, microbatch=micro, batch_size=2, seq_len=32)
            loss = torch.nn.functional.cross_entropy(reference(x).flatten(0, 1), y.flatten())
            (loss / 2).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        assert norm > 0.05  # clipping is active
        set_lr_scale(ref_opt, scale)
        ref_opt.step()
        assert stats.loss == pytest.approx(sum(losses) / 2, rel=1e-6)
        assert stats.grad_norm == pytest.approx(float(norm), rel=1e-5)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_per_stage_grad_norms_combine_to_the_global_norm(cache_dir, data):
    """Stage norms at P = 3 add in quadrature to the P = 1 global norm on the same weights and batch."""
    norms = []
    for stages in (1, 3):
        torch.manual_seed(0)
        model = build_model("llama-1m", vocab_size=data.vocab_size)
        config = tiny(cache_dir, **{"pipeline.schedule": "sync", "pipeline.stages": stages,
                                    "pipeline.microbatches": 1, "delay.correction": "none"})
        norms.append(SimExecutor(config, model, data).train_step(0, 1.0).grad_norm)
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_reduces_the_validation_loss(cache_dir, data, name):
    config = tiny(cache_dir, **{"optim.name": name, "train.steps": 10, "train.batch_size": 8})
    torch.manual_seed(0)
    executor = SimExecutor(config, build_model("llama-1m", vocab_size=data.vocab_size), data)
    before = executor.evaluate()
    assert before == pytest.approx(math.log(256), abs=0.3)  # a fresh model is near uniform over bytes
    for step in range(10):
        executor.train_step(step, 1.0)
    after = executor.evaluate()
    assert after < before - 0.1, (name, before, after)


def test_bfloat16_autocast_matches_float32_to_bf16_precision(cache_dir, data):
    """``train.dtype = bfloat16`` (what ``auto`` picks on CUDA) computes the same loss to bf16 precision."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        model = build_model("llama-1m", vocab_size=data.vocab_size)
        losses[dtype] = SimExecutor(tiny(cache_dir, **{"train.dtype": dtype}), model, data).evaluate()
    assert losses["bfloat16"] != losses["float32"]  # the autocast is really on
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=2e-2)


@pytest.mark.slow
def test_compiled_blocks_follow_the_eager_trajectory(tmp_path, cache_dir):
    """``train.compile`` (per-block torch.compile) trains the same run as eager to float32 rounding: 6 steps of
    2BW + Error Feedback (stale weights swapped in and out around the compiled blocks) within 1e-5."""
    records = {}
    for flag in (False, True):
        train(tiny(cache_dir, **{"train.steps": 6, "train.compile": flag, "train.ckpt_every": 0}),
              out_dir=tmp_path / str(flag))
        records[flag] = read_metrics(tmp_path / str(flag) / "metrics.jsonl")
    eager, compiled = ([r["loss"] for r in records[f]] for f in (False, True))
    assert len(eager) == 6 and eager[-1] < eager[0]
    assert compiled == pytest.approx(eager, abs=1e-5)


def test_compile_leaves_moe_blocks_eager():
    dense, moe = build_model("llama-1m", device="meta"), build_model("moe-1m", device="meta")
    assert dense.compile_blocks() == dense.args.n_layers
    assert moe.compile_blocks() == 0 and not any(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl
                                                 for b in moe.layers)
