"""The parts both executors build from a config, each built in one place.

* device and precision: :func:`resolve_device`, :func:`autocast_for`;
* data: :func:`train_microbatch` (microbatch ``i`` of step ``t``, the same on every rank and on resume) and
  :func:`validation_batches`;
* the pipeline split: :func:`build_stage` (one rank's stage of the distributed runtime) and
  :func:`parameter_placement` (the same split seen from the whole model, for the simulation): a parameter's
  *partition* decides its delay (``schedules.stage_delays``), its *device* decides which gradients are
  clipped together;
* the optimizer is ``bubblefree.optim.build_optimizer(module, config.optim)``, the loss
  ``bubblefree.models.token_loss``; :func:`optimizer_names` names its parameters, the keys of the checkpoint
  state that any split of the model loads (docs/training.md, resume on another layout), and
  :func:`delays_by_name` gives each parameter's delay in a layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from bubblefree.config import Config, TrainConfig
from bubblefree.data import eval_batches, get_batch
from bubblefree.models.split import StageModule, param_stages, split_model
from bubblefree.schedules.delays import n_partitions, parameter_delays, stage_delays

__all__ = ["autocast_for", "build_stage", "delays_by_name", "optimizer_names", "parameter_placement", "resolve_device",
           "train_microbatch", "validation_batches"]


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; asking for CUDA without one is a ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("Invalid train.device: 'cuda' (no CUDA device is available)")
    return torch.device(name)


def autocast_for(dtype: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the forward's autocast context: bf16 for ``bfloat16``, and for ``auto`` on CUDA; else none."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def train_microbatch(cfg: TrainConfig, microbatches: int, tokens: np.ndarray, step: int, index: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch ``index`` (of ``microbatches``, ``pipeline.microbatches`` counted over all replicas) of step
    ``step``."""
    return get_batch(tokens, seed=cfg.seed, step=step, microbatch=index,
                     batch_size=cfg.batch_size // microbatches, seq_len=cfg.seq_len, device=device)


def validation_batches(cfg: TrainConfig, tokens: np.ndarray, device: torch.device,
                       split: str = "val") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``train.eval_batches`` fixed validation batches of ``train.batch_size`` sequences; with
    ``train.test_split`` the even windows of them (``split`` "val") or the odd ones ("test"), in batches of
    ``train.batch_size`` (half as many batches, so a whole evaluation costs what one without the split does)."""
    if not cfg.test_split:
        if split != "val":
            raise ValueError(f"Invalid split: {split!r} (train.test_split is off)")
        return eval_batches(tokens, n_batches=cfg.eval_batches, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                            device=device)
    windows = eval_batches(tokens, n_batches=cfg.eval_batches * cfg.batch_size, batch_size=1, seq_len=cfg.seq_len,
                           device="cpu")
    chosen = windows[{"val": 0, "test": 1}[split]::2]
    return [(torch.cat([x for x, _ in part]).to(device), torch.cat([y for _, y in part]).to(device))
            for part in (chosen[i:i + cfg.batch_size] for i in range(0, len(chosen), cfg.batch_size))]


def build_stage(model: nn.Module, config: Config, stage: int) -> StageModule:
    """Stage ``stage`` of ``model`` cut into ``pipeline.stages`` pieces (sharing the model's parameters).

    A model whose embedding and head share one matrix cannot be cut across processes (the two copies would
    need a gradient exchange every step), so it is refused for more than one stage.
    """
    P = config.pipeline.stages
    if getattr(getattr(model, "args", None), "tie_embeddings", False) and P > 1:
        key, name = ("model.init_from", config.model.init_from) if config.model.init_from else \
            ("model.preset", config.model.preset)
        raise ValueError(f"Invalid {key}: {name!r} ties its embedding and head, which the distributed runtime "
                         f"refuses for pipeline.stages > 1 (docs/runtime.md)")
    return split_model(model, P)[stage]


def parameter_placement(model: nn.Module, optimizer: torch.optim.Optimizer,
                        config: Config) -> tuple[list[int], list[list[nn.Parameter]]]:
    """For the simulation: the delay of every optimizer parameter (in its order) and the parameters of each
    of the ``pipeline.stages`` devices (each clips its own gradients).

    WPipe cuts the model into ``2P`` partitions, device ``s`` holding partitions ``s`` and ``s+P``; every
    other schedule has one partition per device.
    """
    schedule, n_stages = config.pipeline.schedule, config.pipeline.stages
    partition_of = param_stages(model, n_partitions(schedule, n_stages))
    delays = parameter_delays(model, optimizer, schedule, n_stages, partition_of)
    names = {id(p): name for name, p in model.named_parameters()}
    params: list[Any] = [p for group in optimizer.param_groups for p in group["params"]]
    device_of = [partition_of[names[id(p)]] % n_stages for p in params]
    return delays, [[p for p, d in zip(params, device_of) if d == device] for device in range(n_stages)]


def optimizer_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of every optimizer parameter in ``module.named_parameters()``, in the optimizer's order. A
    stage module's names are the whole model's (``models.split``), so the names do not depend on the split."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def delays_by_name(model: nn.Module, config: Config) -> dict[str, int]:
    """Every parameter's delay in the layout of ``config`` (``pipeline.schedule``, ``pipeline.stages``): the
    ``schedules.stage_delays`` entry of its partition, keyed by its name in ``model.named_parameters()``."""
    schedule, n_stages = config.pipeline.schedule, config.pipeline.stages
    delays = stage_delays(schedule, n_stages)
    return {name: delays[part] for name, part in param_stages(model, n_partitions(schedule, n_stages)).items()}
