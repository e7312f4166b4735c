"""The memory plan: bytes per pipeline stage for every schedule, before a run (``bubblefree plan``, docs/memory.md).

For each schedule and each rank (a pipeline stage; WPipe and interleaved 1F1B hold two model partitions per
rank) the plan adds up, in bytes:

* ``params``: the rank's parameters (float32 master weights, whatever the compute dtype);
* ``stash``: the stashed weight versions, ``d`` per parameter of delay ``d`` (2BW 1, PipeDream ``P-1-s``),
  the delay ``d`` being the staleness the schedule's timeline derives (``schedules.timeline``). The steps
  under way of the schedules the distributed runtime runs asynchronously (2BW, PipeDream) compute on views of
  the stash and the live weights, not copies (``distributed.stage``; every optimizer of the registry computes
  its update before applying it, ``DelayedOptimizer.stale_until_used``);
* ``grads``: one gradient per parameter, per step under way for those asynchronous schedules (each step's
  view of the weights collects its own), as many as the timeline's ``open_steps``;
* ``optim``: the optimizer's state (``optim.registry.state_numel``: AdamW 2 floats per parameter, Muon's
  momentum on hidden matrices, SOAP's Gram matrices and eigenbases, ...);
* ``updates``: the update buffers the optimizer recycles between steps, one per parameter
  (``optim.base``, Recycled update buffers);
* ``correction``: the correction's buffers (``delay.correction_buffers``: EF's ring of ``d`` updates, the
  prediction's last change, Nesterov's momentum, DC-ASGD-a's mean square);
* ``activations``: the peak number of microbatches in flight on the rank (the timeline's
  ``peak_activations``) times what one microbatch leaves there between its forward and its backward
  (:func:`activation_bytes`).

Beside them the timeline's predicted step time (in units of the ``costs``) and idle fraction (the bubble).
The numbers follow the distributed runtime: its unit of work is a microbatch, except for PipeDream, whose
unit is a replica's whole share of the step (``distributed.rank``), so its activations in flight count
``M / R`` microbatches each. With ``R`` data-parallel replicas every replica holds a whole pipeline and
runs ``M / R`` microbatches per step; nothing is sharded across replicas, so a stage's bytes are per device.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bubblefree.config import Config
from bubblefree.delay import correction_buffers
from bubblefree.errors import UserError
from bubblefree.models import Transformer, token_loss
from bubblefree.models.llama import ModelArgs
from bubblefree.models.presets import model_args
from bubblefree.models.split import StageModule, param_stages, split_model
from bubblefree.optim.registry import is_hidden_matrix, state_numel
from bubblefree.schedules import n_partitions, stage_delays
from bubblefree.schedules.ir import build_schedule, check_schedule
from bubblefree.schedules.table import SCHEDULE_SPECS, SIMULATED_SCHEDULES, Unit
from bubblefree.schedules.timeline import Costs, simulate

__all__ = ["PARTS", "VERSIONED", "StageMemory", "activation_bytes", "check_memory", "device_memory", "format_plan",
           "memory_floor", "plan_memory"]

VERSIONED = tuple(name for name, spec in SCHEDULE_SPECS.items() if spec.versioned)
"""Schedules whose steps the distributed runtime computes on weight versions of their own, each collecting its
own gradient (its asynchronous loop, ``distributed.executor.ASYNC_SCHEDULES``); the others run on the live
weights (torch's stock schedules). The schedule table's ``ScheduleSpec.versioned``."""

PARTS = ("params", "stash", "grads", "optim", "updates", "correction", "activations")
"""The columns of a stage's plan, in the order they are printed."""


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes one rank holds at its peak, by kind (module docstring)."""

    params: int
    stash: int
    grads: int
    optim: int
    updates: int
    correction: int
    activations: int

    @property
    def total(self) -> int:
        return sum(getattr(self, part) for part in PARTS)


@contextmanager
def _flash_attention_on_meta():
    """Make ``F.scaled_dot_product_attention`` save what the fused kernels save (CPU flash, CUDA flash and
    memory-efficient): the inputs, the output and a float32 log-sum-exp per query, never the ``T x T`` weights.
    On the meta device torch would pick the math path, which does save them."""
    real = F.scaled_dot_product_attention

    class _Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):  # type: ignore[override]
            out = torch.empty_like(q)
            ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
            return out

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            q, k, v, _, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def fused(q, k, v, *args, **kwargs):
        return _Fused.apply(q, k, v) if q.is_meta else real(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def activation_bytes(stage: StageModule, *, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one microbatch of ``batch`` sequences keeps alive on ``stage`` from its forward to its backward.

    That is every tensor autograd saves for the backward (parameters and views of them excluded), the stage's
    input (the activation it received) and its output (kept for the backward), each storage counted once;
    the last stage includes the loss's float32 logits. ``stage`` lives on the meta device, so this costs
    neither memory nor compute; ``dtype`` is the activations' (a bfloat16 plan converts the stage: an estimate
    of autocast, which keeps norms and the loss in float32). Measured against a real forward on the CPU by the
    tests, exactly.
    """
    params = {id(p) for p in stage.parameters()}
    kept: dict[int, Tensor] = {}

    def pack(t: Tensor) -> Tensor:
        base = t if t._base is None else t._base
        if id(base) not in params:
            kept[id(base)] = base
        return t

    device = next(stage.parameters()).device
    args = stage.args
    if stage.is_first:
        x = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    else:
        x = torch.zeros(batch, seq_len, args.dim, dtype=dtype, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _flash_attention_on_meta():
        out = stage(x)
        if stage.is_last:
            out = token_loss(out, torch.zeros(batch, seq_len, dtype=torch.long, device=device))
    for t in (x, out):
        kept[id(t)] = t
    return sum(t.untyped_storage().nbytes() for t in kept.values())


def _rank_partitions(schedule: Any) -> list[list[int]]:
    """The model partitions (schedule stages) each rank holds."""
    return [[s for s in range(schedule.n_stages) if schedule.rank_of(s) == r] for r in range(schedule.n_ranks)]


def plan_memory(config: Config, *, replicas: int = 1, schedules: Sequence[str] = SIMULATED_SCHEDULES,
                costs: Costs = Costs(), steps: int = 8) -> list[dict[str, Any]]:
    """Per schedule: ``{"schedule", "step_time", "idle_fraction", "stages": [StageMemory per rank]}``.

    From ``config``: ``model.preset`` (at ``model.vocab_size``, or the preset's own vocabulary when 0) or the
    ``model.init_from`` folder's shapes, ``optim.name`` (and SOAP's ``optim.max_precond_dim``),
    ``delay.correction`` (and ``taylor_adaptive``), ``train.batch_size`` / ``pipeline.microbatches`` (sequences
    per microbatch), ``train.seq_len``, ``train.dtype`` (``auto`` plans float32) and ``pipeline.stages``.
    ``replicas`` data-parallel copies split the step's ``M`` microbatches. ``step_time`` is one optimizer step in
    units of ``costs`` (a forward of one microbatch through one stage costs ``costs.forward``), averaged over
    ``steps`` steps, fill and drain included.
    """
    pipe, train = config.pipeline, config.train
    P, M = pipe.stages, pipe.microbatches
    if replicas < 1 or M % replicas:
        raise ValueError(f"Invalid replicas: {replicas} (must divide pipeline.microbatches = {M})")
    local_m = M // replicas
    dtype = torch.bfloat16 if train.dtype == "bfloat16" else torch.float32
    model = Transformer(model_args(config.model, vocab_size=config.model.vocab_size or None), device="meta")
    shapes = {name: (tuple(p.shape), is_hidden_matrix(name, p)) for name, p in model.named_parameters()}
    precond = config.optim.max_precond_dim if config.optim.max_precond_dim > 0 else 10000  # SOAP's default
    cache: dict[tuple[int, int], dict[str, int]] = {}

    def partition(index: int, n_parts: int) -> dict[str, int]:
        """Parameter, state and activation sizes of one of ``n_parts`` partitions (cached)."""
        if (index, n_parts) not in cache:
            placed = param_stages(model, n_parts)
            names = [n for n, s in placed.items() if s == index]
            part = split_model(model, n_parts)[index]
            if dtype != torch.float32:
                part = part.to(dtype)
            cache[(index, n_parts)] = {
                "numel": sum(torch.Size(shapes[n][0]).numel() for n in names),
                "optim": sum(state_numel(config.optim.name, shapes[n][0], matrix=shapes[n][1],
                                         max_precond_dim=precond) for n in names),
                "activation": activation_bytes(part, batch=train.batch_size // M, seq_len=train.seq_len,
                                               dtype=dtype),
            }
        return cache[(index, n_parts)]

    rows: list[dict[str, Any]] = []
    for name in schedules:
        try:
            spec = check_schedule(name, P, local_m, steps=steps)
            unit = local_m if spec.unit is Unit.STEP else 1  # microbatches per unit of work (module docstring)
            schedule = build_schedule(name, P, local_m // unit, steps=steps)
            if schedule.n_stages > model.args.n_layers:
                raise ValueError(f"needs {schedule.n_stages} model partitions, the model has "
                                 f"{model.args.n_layers} layers")
        except ValueError as e:  # this layout cannot run the schedule: say so in its row, plan the others
            rows.append({"schedule": name, "error": str(e)})
            continue
        timeline = simulate(schedule, dataclasses.replace(costs, forward=costs.forward * unit,
                                                          backward=costs.backward * unit,
                                                          weight=costs.weight * unit, update=costs.update))
        delays, in_flight = timeline.staleness(), timeline.peak_activations()
        under_way = timeline.open_steps() if spec.versioned else [0] * schedule.n_stages
        stages = []
        for held in _rank_partitions(schedule):
            parts = {"params": 0, "stash": 0, "grads": 0, "optim": 0, "updates": 0, "correction": 0,
                     "activations": 0}
            for s in held:
                sizes = partition(s, schedule.n_stages)
                weights = sizes["numel"] * 4  # float32 master weights (and gradients, updates, buffers alike)
                parts["params"] += weights
                parts["grads"] += max(1, under_way[s]) * weights
                parts["updates"] += weights
                parts["stash"] += delays[s] * weights
                parts["correction"] += correction_buffers(config.delay.correction, delays[s],
                                                          taylor_adaptive=config.delay.taylor_adaptive) * weights
                parts["optim"] += sizes["optim"] * 4
                parts["activations"] += in_flight[s] * unit * sizes["activation"]
            stages.append(StageMemory(**parts))
        rows.append({"schedule": name, "step_time": timeline.makespan / steps,
                     "idle_fraction": timeline.idle_fraction(), "stages": stages})
    return rows


def _size(n: int) -> str:
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{n} B"


def format_plan(rows: list[dict[str, Any]]) -> str:
    """The plan as a text table: one line per schedule and rank (rows whose schedule cannot run this layout
    say why)."""
    head = ["schedule", "step", "bubble", "rank", *PARTS, "total"]
    lines = [head]
    for row in rows:
        if "error" in row:
            lines.append([row["schedule"], "-", "-", "-", row["error"]])
            continue
        for r, stage in enumerate(row["stages"]):
            first = [row["schedule"], f"{row['step_time']:.1f}", f"{row['idle_fraction']:.1%}"] if r == 0 else \
                ["", "", ""]
            lines.append([*first, str(r), *(_size(getattr(stage, p)) for p in PARTS), _size(stage.total)])
    widths = [max(len(line[i]) for line in lines if len(line) == len(head) and i < len(line))
              for i in range(len(head))]
    out = []
    for line in lines:
        if len(line) != len(head):  # a refused schedule: its reason runs to the end of the line
            out.append("  ".join(f"{c:<{w}}" for c, w in zip(line[:4], widths)) + "  " + line[4])
        else:
            out.append("  ".join(f"{c:<{w}}" if i in (0, 3) else f"{c:>{w}}" for i, (c, w) in
                                 enumerate(zip(line, widths))))
    return "\n".join(out)


# ----------------------------------------------------------------------- the floor a run checks at its start

def memory_floor(config: Config, args: ModelArgs, *, activations: bool = True) -> dict[str, int]:
    """Bytes a training run of ``config`` on a model of shape ``args`` holds at once on one device, at least, by
    part; counted on the meta device, so nothing is allocated (``train.loop.check_lengths`` refuses a run whose
    floor exceeds its device, before anything is written):

    * ``model``: weights, gradients, optimizer state, stashed weight versions and correction buffers, float32
      (as :func:`plan_memory` counts them): the whole model in the simulation, the largest stage in the
      distributed runtime (one process per stage); ``optimizer``: the optimizer state's share of it;
    * ``batch``: what one microbatch (``train.batch_size / pipeline.microbatches`` sequences) keeps for its
      backward, and its token windows (int64);
    * ``evaluation``: the token windows of one evaluation, ``train.eval_batches x train.batch_size`` sequences,
      all held at once (``train.build.validation_batches``).

    The run holds ``model`` and the larger of the other two. A floor, not a plan: the activations are the
    growth per sequence, ``activation_bytes`` at two sequences less at one (the part that does not grow with
    the batch, and everything a schedule keeps in flight beyond one microbatch, left out), at half their
    float32 bytes where the forward runs in bfloat16 (every saved element takes at least two bytes).
    ``activations=False`` counts only each block's input and the logits instead (a test checks that this is
    below the measured bytes): a cheaper floor, without the meta forwards through the model (a second each for
    a 32-layer model on a busy CPU).
    """
    pipe, train = config.pipeline, config.train
    model = Transformer(args, device="meta")
    parts = n_partitions(pipe.schedule, pipe.stages)
    placed, delays = param_stages(model, parts), stage_delays(pipe.schedule, pipe.stages)
    precond = config.optim.max_precond_dim if config.optim.max_precond_dim > 0 else 10000  # SOAP's default
    state, optimizer = [0] * pipe.stages, [0] * pipe.stages  # float32 elements per device: all, optimizer's
    for name, p in model.named_parameters():
        part = placed[name]
        d = delays[part]
        buffers = correction_buffers(config.delay.correction, d, taylor_adaptive=config.delay.taylor_adaptive)
        optim = state_numel(config.optim.name, tuple(p.shape), matrix=is_hidden_matrix(name, p),
                            max_precond_dim=precond)
        state[part % pipe.stages] += p.numel() * (2 + d + buffers) + optim
        optimizer[part % pipe.stages] += optim
    half = train.dtype == "bfloat16" or (train.dtype == "auto" and config.train.device != "cpu"
                                         and torch.cuda.is_available())
    per_seq = train.batch_size // pipe.microbatches
    windows = 8 * (train.seq_len + 1)  # one sequence's int64 token window (inputs and targets are views of it)

    def saved(stage: StageModule) -> int:
        if activations:
            grow = (activation_bytes(stage, batch=2, seq_len=train.seq_len)
                    - activation_bytes(stage, batch=1, seq_len=train.seq_len))
        else:  # each block's input (its first norm's backward keeps it) and the last stage's float32 logits
            grow = 4 * train.seq_len * (len(stage.layers) * args.dim + (args.vocab_size if stage.is_last else 0))
        return per_seq * (grow // 2 if half else grow)

    if pipe.runtime == "distributed":  # the device of the largest stage (the runtime runs no wpipe: P partitions)
        stages = split_model(model, pipe.stages)
        held = [4 * state[s] + saved(stage) for s, stage in enumerate(stages)]
        s = max(range(pipe.stages), key=held.__getitem__)
        model_bytes, optim_bytes, batch_bytes = 4 * state[s], 4 * optimizer[s], held[s] - 4 * state[s]
    else:
        model_bytes, optim_bytes = 4 * sum(state), 4 * sum(optimizer)
        batch_bytes = saved(split_model(model, 1)[0])
    return {"model": model_bytes, "optimizer": optim_bytes, "batch": batch_bytes + per_seq * windows,
            "evaluation": train.eval_batches * train.batch_size * windows}


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory ``device`` has: a GPU's total; for the CPU the machine's physical memory, or this
    process's cgroup limit where lower (a container's). None where the system does not say."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    limits = [Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")]  # cgroup v1
    try:  # cgroup v2: "0::/PATH", the process's own group under the unified hierarchy
        own = [line.split("::", 1)[1] for line in Path("/proc/self/cgroup").read_text().splitlines()
               if line.startswith("0::")]
        limits += [Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max" for path in own]
    except OSError:
        pass
    for path in [*limits, Path("/sys/fs/cgroup/memory.max")]:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" means no limit
            total = min(total, int(text))
    return total


def check_memory(config: Config, args: ModelArgs, device: torch.device, *, vocab_key: str,
                 activations: bool = True) -> None:
    """Refuse a run whose :func:`memory_floor` exceeds ``device``'s memory, in one line naming the key that weighs
    most: ``train.batch_size`` (a microbatch), ``train.eval_batches`` (an evaluation's windows), or for the model
    ``vocab_key`` (the key that sets the vocabulary) when the vocabulary matrices are half of the parameters,
    ``optim.max_precond_dim`` when SOAP's state is half of the model's bytes, else ``model.preset`` (or
    ``model.init_from``). ``activations``: as for :func:`memory_floor`."""
    have = device_memory(device)
    floor = memory_floor(config, args, activations=activations)
    need = floor["model"] + max(floor["batch"], floor["evaluation"])
    if have is None or need <= have:
        return
    t = config.train
    model = Transformer(args, device="meta")
    vocab = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    model_key = (vocab_key if 2 * vocab >= model.num_params() else
                 "optim.max_precond_dim" if config.optim.name == "soap" and 2 * floor["optimizer"] >= floor["model"]
                 else "model.init_from" if config.model.init_from else "model.preset")
    heaviest = max(("model", "batch", "evaluation"), key=floor.__getitem__)
    key = {"model": model_key, "batch": "train.batch_size", "evaluation": "train.eval_batches"}[heaviest]
    section, name = key.split(".")
    value = getattr(getattr(config, section), name)
    has = (f"this machine's {_size(have)}" if device.type == "cpu" else
           f"the {_size(have)} of {torch.cuda.get_device_name(device)}")
    raise UserError(
        f"Invalid {key}: {value!r} (the run needs at least {_size(need)} of memory, more than {has}: "
        f"{_size(floor['model'])} for the model's weights, gradients, optimizer state and buffers"
        f"{' on its largest stage' if config.pipeline.runtime == 'distributed' else ''}, "
        f"{_size(floor['batch'])} for a microbatch of {t.batch_size // config.pipeline.microbatches} sequences of "
        f"{t.seq_len} tokens, {_size(floor['evaluation'])} for an evaluation's {t.eval_batches * t.batch_size} "
        f"sequences; lower {key})")
