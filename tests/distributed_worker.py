"""Helper for tests/test_distributed.py: one rank of a tiny pipeline run, spawned by the test."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bubblefree.models import ModelArgs, Transformer
from bubblefree.optim.schedule import lr_scale
from bubblefree.train.config import Config

VOCAB = 64


def tiny_model(seed: int, n_layers: int = 4) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelArgs(vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                 mlp_hidden=64, max_seq_len=64))


def tiny_data(seed: int = 0) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    return SimpleNamespace(train=rng.integers(0, VOCAB, 20000, dtype=np.int64).astype(np.uint16),
                           val=rng.integers(0, VOCAB, 4000, dtype=np.int64).astype(np.uint16), vocab_size=VOCAB)


def run(executor, config: Config, start: int, stop: int, *, eval_at: tuple[int, ...] = ()) -> list:
    """Steps ``start..stop-1``; returns ``[(step, loss)]`` (rank 0) and evaluates after the steps in ``eval_at``."""
    cfg, out = config.train, []
    for step in range(start, stop):
        stats = executor.train_step(step, lr_scale(step, cfg.steps, warmup_frac=cfg.warmup_frac,
                                                   min_lr_frac=cfg.min_lr_frac))
        if stats is not None:
            out.append((step, stats.loss, stats.grad_norm))
        if step in eval_at:
            executor.evaluate()
    return out


def worker(index: int, config: Config, nprocs: int, port: int, out_dir: str, plan: dict) -> None:
    from bubblefree.distributed import DistributedExecutor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE=str(nprocs))
    torch.set_num_threads(1)
    model = tiny_model(config.train.seed, plan.get("n_layers", 4))
    executor = DistributedExecutor(config, model, tiny_data(), out_dir=out_dir, timeout_s=30)
    losses = run(executor, config, 0, plan["steps"], eval_at=tuple(plan.get("eval_at", ())))
    val = executor.evaluate()
    state = executor.state_dict()
    executor.close()
    if index == 0:
        torch.save({"losses": losses, "val": val, "state": state}, Path(out_dir) / "result.pt")
