"""Helper for tests/test_distributed.py: one rank of a tiny pipeline run, spawned by the test."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from bubblefree.config import Config
from bubblefree.models import ModelArgs, Transformer
from bubblefree.optim.schedule import lr_scale

VOCAB = 64


def tiny_model(seed: int, n_layers: int = 4, n_experts: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelArgs(vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                 mlp_hidden=64, max_seq_len=64, n_experts=n_experts, top_k=2))


def tiny_data(seed: int = 0) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    return SimpleNamespace(train=rng.integers(0, VOCAB, 20000, dtype=np.int64).astype(np.uint16),
                           val=rng.integers(0, VOCAB, 4000, dtype=np.int64).astype(np.uint16), vocab_size=VOCAB)


def run(executor, config: Config, start: int, stop: int, *, eval_at: tuple[int, ...] = ()) -> list:
    """Steps ``start..stop-1``; returns ``[(step, loss, grad_norm, aux_loss, lr)]`` (the writer's) and
    evaluates after the steps in ``eval_at``."""
    cfg, out = config.train, []
    for step in range(start, stop):
        stats = executor.train_step(step, lr_scale(step, cfg.steps, warmup_frac=cfg.warmup_frac,
                                                   min_lr_frac=cfg.min_lr_frac))
        if stats is not None:
            out.append((step, stats.loss, stats.grad_norm, stats.aux_loss, stats.lr))
        if step in eval_at:
            executor.evaluate()
    return out


def worker(index: int, config: Config, nprocs: int, port: int, out_dir: str, plan: dict) -> None:
    """Run ``plan["steps"]`` steps; with ``plan["resume_at"] = k`` also checkpoint after step k (to a file every
    rank reads back, as the training loop does), and afterwards resume a fresh executor from it to the end."""
    from bubblefree.distributed import DistributedExecutor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE=str(nprocs))
    torch.set_num_threads(1)

    def make(mesh=None) -> DistributedExecutor:
        model = tiny_model(config.train.seed, n_experts=plan.get("n_experts", 0))
        return DistributedExecutor(config, model, tiny_data(), out_dir=out_dir, mesh=mesh, timeout_s=30)

    steps, k, eval_at = plan["steps"], plan.get("resume_at"), tuple(plan.get("eval_at", ()))
    executor = make()
    ckpt = Path(out_dir) / "ckpt.pt"
    if k is None:
        losses = run(executor, config, 0, steps, eval_at=eval_at)
    else:
        losses = run(executor, config, 0, k, eval_at=eval_at)
        state = executor.state_dict()
        if executor.is_writer:
            torch.save(state, ckpt)
        dist.barrier()
        losses += run(executor, config, k, steps, eval_at=eval_at)
    result = {"losses": losses, "val": executor.evaluate(), "state": executor.state_dict()}
    executor.close()
    if k is not None:
        resumed = make(executor.mesh)
        resumed.load_state_dict(torch.load(ckpt, weights_only=True))
        result["resumed"] = {"losses": run(resumed, config, k, steps), "state": resumed.state_dict()}
        resumed.close()
    if executor.is_writer:
        torch.save(result, Path(out_dir) / "result.pt")
    dist.destroy_process_group()  # an exit with gloo's threads still running can abort the process
