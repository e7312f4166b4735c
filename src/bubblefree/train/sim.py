"""The single-process executor: an exact simulation of a (possibly asynchronous) pipeline's training step.

One optimizer step ``t`` of a pipeline with ``P`` stages and ``M`` microbatches computes (docs/spec.md)

    g_t = (1/M) sum_m grad f(x_{t-d_s}; b_{t,m})   on the parameters of stage s,
    x_{t+1} = x_t - u_t (+ the configured correction),

with the per-stage delays ``d_s`` of the schedule (``schedules.stage_delays``: 0 for sync/gpipe/1f1b, 1 for
PipeDream-2BW, ``P-1-s`` for PipeDream). :class:`bubblefree.delay.DelayedOptimizer` keeps the stash of old
weights and the state of the correction; inside ``stale_params()`` each parameter holds the version its
stage's forward and backward would see. The forward and backward of the whole model run in one process, which
gives the same gradients as the stage-split pipeline (activations pass through unchanged). Each stage then clips
its own gradients to ``grad_clip / sqrt(P)`` as the distributed runtime does (``optim.clip_stage_grads``), so
the simulation and the runtime follow one trajectory. A step whose loss or gradient norm is not finite
applies no update (docs/reliability.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from bubblefree.config import Config
from bubblefree.delay import build_delayed
from bubblefree.models import aux_loss_sum, token_loss
from bubblefree.optim import build_optimizer, clip_stage_grads, set_lr_scale
from bubblefree.train.build import (
    autocast_for,
    optimizer_names,
    parameter_placement,
    resolve_device,
    train_microbatch,
    validation_batches,
)
from bubblefree.train.executor import StepStats

__all__ = ["SimExecutor"]


class SimExecutor:
    """:class:`~bubblefree.train.executor.Executor` that runs the pipeline's update rule in one process.

    ``model`` is a ``bubblefree.models.Transformer``; ``data`` a ``bubblefree.data.TokenData``. Gradients of
    ``pipeline.microbatches`` microbatches of ``batch_size / microbatches`` sequences are accumulated per step.
    """

    is_writer = True  # one process: it writes the run's outputs

    def __init__(self, config: Config, model: torch.nn.Module, data: Any):
        self.config = config
        self.data = data
        self.device = resolve_device(config.train.device)
        self.model = model.to(self.device)
        model.set_aux_loss_scale(1 / config.pipeline.microbatches)  # averaged like the microbatch losses
        self._autocast = autocast_for(config.train.dtype, self.device)

        self.optimizer = build_optimizer(model, config.optim)
        delays, self.stage_params = parameter_placement(model, self.optimizer, config)
        self.delayed = build_delayed(self.optimizer, delays=delays, config=config.delay,
                                     total_steps=config.train.steps)
        self.names = optimizer_names(model, self.optimizer)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(x)
        return token_loss(logits, y)

    def train_step(self, step: int, lr_scale: float) -> StepStats:
        cfg, n_micro = self.config, self.config.pipeline.microbatches
        self.model.train()
        set_lr_scale(self.optimizer, lr_scale)
        self.delayed.zero_grad()
        total = torch.zeros((), device=self.device)
        aux: torch.Tensor | float = 0.0  # a device tensor (for MoE models): read once, after the backward
        with self.delayed.stale_params():
            for micro in range(n_micro):
                x, y = train_microbatch(cfg.train, n_micro, self.data.train, step, micro, self.device)
                loss = self._loss(x, y)
                (loss / n_micro).backward()
                total += loss.detach()
                aux = aux + aux_loss_sum(self.model)
        norms = [clip_stage_grads(params, cfg.train.grad_clip, n_stages=len(self.stage_params))
                 for params in self.stage_params]
        # The norms are host floats, so the device has finished the backward: reading the loss costs no wait.
        loss, grad_norm = float(total) / n_micro, math.sqrt(sum(n * n for n in norms))
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.delayed.step()
        # else the batch leaves weights, optimizer, stash and Error Feedback as they were; the loop stops the
        # run or counts the skip (train.nonfinite)
        return StepStats(loss=loss, grad_norm=grad_norm, aux_loss=float(aux) / n_micro,
                         lr=self.optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def evaluate(self, split: str = "val") -> float:
        """Mean cross-entropy over the fixed ``split`` batches (``build.validation_batches``) at the current
        weights."""
        self.model.eval()
        batches = validation_batches(self.config.train, self.data.val, self.device, split)
        losses = [self._loss(x, y) for x, y in batches]
        return float(torch.stack(losses).mean())

    def state_dict(self) -> dict[str, Any]:
        """The layout-free state (``train.checkpoint``): weights and optimizer state keyed by parameter name."""
        return {"layout": {"runtime": "sim", "stages": self.config.pipeline.stages, "replicas": 1},
                "model": self.model.state_dict(), "optimizer": self.delayed.named_state_dict(self.names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a layout-free state written at any layout (``train.checkpoint.layout_free``)."""
        self.model.load_state_dict(state["model"])
        self.delayed.load_named_state_dict(state["optimizer"], self.names)

    def close(self) -> None:
        pass
