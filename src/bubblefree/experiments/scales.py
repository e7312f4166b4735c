"""How big the reproduction runs are: ``smoke`` (seconds per run) and ``smoke4x`` (its tuned miniature of
``long4x``), ``cpu`` (the default), ``long``, ``long4x`` and ``gpu``.

A :class:`Scale` holds the base run (built from the run presets of ``bubblefree.train.presets``), the number
of seeds, the learning-rate factors of the synchronous sweep, and the model presets of the suites that need
another one (a 32-layer narrow ``deep-*`` model for the depth-16 schedules, an MoE). Sizing:

- ``smoke``: the ``smoke`` run preset (llama-1m, byte tokenizer, 40 steps of 8 x 64 tokens), one seed, a
  two-point sweep that never extends: every suite finishes in minutes.
- ``cpu``: the ``demo`` run's model and batch (llama-5m at vocabulary 4096, sequence 128, batch 16); 200
  steps, 2 seeds, a three-point sweep (0.5x-2x the registry rate, extended up to 0.125x-8x while the best
  sits at an end): the ``optimizers`` suite is 36 runs plus the extensions (docs/results.md gives the time
  they took). One thread per run: on a shared machine a second thread waiting for a busy core makes steps
  many times slower.
- ``gpu``: SmolLM2-135M's shapes (arXiv 2606.30634 trains 135M/360M) on the embedded corpus with an 8192 BPE
  vocabulary, sequence 512, batch 32, 600 steps (9.8M tokens, 0.09 per parameter: the cpu scale's 0.08),
  3 seeds, a sweep extended up to 0.25x-4x. Sized, without a GPU to measure on, from the FLOP count:
  0.77 GFLOP per token (``bench.train.flops_per_token``), 1.26e13 per step, 64 ms at an assumed 20 % MFU of
  an H100/H200's 989 TFLOPS, plus about 25 ms of optimizer, delay and launch overhead: about 0.09 s per step,
  a minute per run with setup and evaluation, so ``reproduce error-feedback --scale gpu --seeds 1
  --optimizers muon`` (6-7 runs) fits a 10-minute window (docs/results.md). ``bubblefree bench device``
  measures the step time of exactly this run.
- ``long``: the paper's horizon, about 20 tokens per parameter counting every trainable parameter (the
  paper's 135M/360M runs are Chinchilla-style): ``byte-0.5m`` (0.47M parameters, 0.42M outside the embedding
  and head) on the byte tokenizer, 1200 steps of 32 x 256 tokens (9.8M tokens: 20.7 tokens per parameter,
  23 per non-embedding parameter; 1.3 passes over the 7.7M-byte training split), 2 seeds, the cpu scale's
  sweep. The ``horizon`` suite trains it to 0.05x-2x that length (1 to 41 tokens per parameter); a 16-layer
  model of the same size for the depth-2 and depth-8 schedules, a 0.5M MoE. docs/results.md has the time per run.
  The ``steps`` suite trains the same tokens in 4x the steps (8 x 256, 4800 steps), then at the base length; a 16x
  point (2 x 256, 19,200 steps) costs about an hour per run on one core (docs/results.md) and is left out.
- ``long4x``: the claim's regime, the base of every suite there. The long scale's model and tokens in 4x the
  steps (8 x 256, 4800 steps; evaluation windows, warmup share and log lines kept as the ``steps`` suite keeps
  them: :func:`steps_overrides`), where the ``steps`` suite found Muon's and AdamW's 2BW + EF indistinguishable
  from sync. Every suite there tunes every arm (``Scale.tuned``: each arm sweeps its own rate at the choice
  seed, reports other seeds on the test windows), 3 reported seeds, 5 for the two arms a verdict is read from
  (sync and 2BW + EF). Its runs are the ``steps`` suite's 4x runs where they coincide (same config, same id).
  Depths 2, 8 and 16 on the 16-layer deep model.
- SOAP preconditions every dimension up to ``optim.max_precond_dim``, below the vocabulary and above every
  hidden dimension at every real scale (2048 at cpu, 4096 at gpu, 255 at long): the paper's regime, where the 49152
  vocabulary exceeds SOAP's default 10000 and the widest hidden dimension (2560) does not. At cpu scale with
  the default, the 4096-wide embedding and head would be preconditioned too, at several times the cost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bubblefree.config import Config, apply_overrides
from bubblefree.errors import UserError
from bubblefree.train.presets import get_preset

__all__ = ["SCALES", "Scale", "get_scale", "steps_overrides"]


@dataclass(frozen=True, kw_only=True)
class Scale:
    """One size of the reproduction."""

    name: str
    base: Config
    """The synchronous-comparable base run; every experiment changes a few keys of it."""

    seeds: int
    """Seeds per configuration (the synchronous baseline always gets at least 2, for the noise floor)."""

    lr_factors: tuple[float, ...]
    """The synchronous sweep tries the optimizer's registry default learning rate times each factor."""

    lr_extend: int
    """While an optimizer's best rate sits at an end of the rates tried, the sweep tries one more factor beyond
    it (the grid's ratio again), up to this many beyond each end: a best rate at the edge says the optimum may
    lie past it."""

    deep_model: str
    """Model preset with >= 32 layers, so every stage of WPipe's 2P partitions at depth 16 holds a layer."""

    moe_model: str
    """Model preset of the ``moe`` suite."""

    depths: tuple[int, ...] = (2, 4, 8, 16)
    """Pipeline depths of the ``schedules`` suite."""

    horizons: tuple[float, ...] = (0.25, 0.5, 1.0)
    """Lengths of the ``horizon`` suite's runs as multiples of the base run's steps (each a full run with
    its own warmup and cosine decay, not a cut of a longer one)."""

    step_factors: tuple[int, ...] = (1, 4)
    """Points of the ``steps`` suite: the base run's tokens in ``f`` times the steps (batch divided by ``f``),
    in the order the suite runs them."""

    tuned: bool = False
    """Every suite tunes every arm (``experiments.sweeps.Cell``: each arm sweeps its own rate at the choice seed,
    the reported seeds are others, on the test windows), not only the synchronous one."""

    verdict_seeds: int = 0
    """At a tuned scale, the reported seeds of the arms a verdict is read from (sync and 2BW + EF), when more
    than ``seeds``: the verdicts turn on their intervals."""


# Evaluation and logging settings shared by every scale's runs: the progress bar is the suite's, not the run's.
_QUIET = {"log.progress": False, "train.ckpt_every": 0, "train.ckpt_keep": 1}


def _smoke() -> Scale:
    base = apply_overrides(get_preset("smoke"), {
        **_QUIET, "pipeline.schedule": "sync", "delay.correction": "none",
        "train.eval_every": 0, "train.eval_batches": 4, "train.log_every": 5,
    })
    return Scale(name="smoke", base=base, seeds=1, lr_factors=(0.5, 1.0), lr_extend=0, deep_model="deep-1m",
                 moe_model="moe-1m", horizons=(0.5, 1.0), step_factors=(1, 2))


def _cpu() -> Scale:
    base = apply_overrides(get_preset("sync-baseline"), {
        **_QUIET, "train.steps": 200, "train.eval_every": 50, "train.eval_batches": 8, "train.log_every": 10,
        "train.threads": 1, "optim.max_precond_dim": 2048,
    })
    return Scale(name="cpu", base=base, seeds=2, lr_factors=(0.5, 1.0, 2.0), lr_extend=2, deep_model="deep-3m",
                 moe_model="moe-6m")


def _gpu() -> Scale:
    base = apply_overrides(get_preset("sync-baseline"), {
        **_QUIET, "model.preset": "smollm2-135m", "data.vocab_size": 8192, "train.steps": 600,
        "train.batch_size": 32, "train.seq_len": 512, "train.eval_every": 100, "train.eval_batches": 16,
        "train.log_every": 20, "train.device": "cuda", "optim.max_precond_dim": 4096,
    })
    return Scale(name="gpu", base=base, seeds=3, lr_factors=(0.5, 1.0, 2.0), lr_extend=1, deep_model="deep-30m",
                 moe_model="moe-20m", horizons=(0.25, 1.0))


def _long() -> Scale:
    # 20 tokens per parameter, the paper's horizon, on one core: the byte vocabulary keeps 90 % of the 0.47M
    # parameters outside the embedding and head; 32 x 256-token batches keep each matmul large enough that a
    # step is compute-bound, and compiling the blocks fuses the elementwise work around them (faster per step,
    # docs/throughput.md).
    base = apply_overrides(get_preset("sync-baseline"), {
        **_QUIET, "model.preset": "byte-0.5m", "data.tokenizer": "byte", "train.steps": 1200,
        "train.batch_size": 32, "train.seq_len": 256, "train.eval_every": 200, "train.eval_batches": 32,
        "train.log_every": 20, "train.threads": 1, "train.compile": True, "optim.max_precond_dim": 255,
    })
    return Scale(name="long", base=base, seeds=2, lr_factors=(0.5, 1.0, 2.0), lr_extend=2,
                 deep_model="byte-deep-0.5m", moe_model="byte-moe-0.5m", depths=(2, 8),
                 horizons=(0.05, 0.25, 1.0, 2.0), step_factors=(4, 1))


def steps_overrides(scale: Scale, factor: int) -> dict[str, Any]:
    """The base run's tokens in ``factor`` times the steps: the batch divided by ``factor``; the warmup keeps its
    share (``train.warmup_frac``), evaluations and log lines their count, and the evaluation its windows
    (``eval_batches x batch_size`` windows, split into validation and test halves by ``train.test_split``)."""
    t, pipe = scale.base.train, scale.base.pipeline
    if factor < 1 or t.batch_size % factor:
        raise UserError(f"Invalid steps factor: {factor} (must divide train.batch_size = {t.batch_size})")
    batch = t.batch_size // factor
    return {"train.batch_size": batch, "train.steps": t.steps * factor, "train.eval_every": t.eval_every * factor,
            "train.eval_batches": t.eval_batches * factor, "train.log_every": t.log_every * factor,
            "train.test_split": True, "pipeline.microbatches": min(pipe.microbatches, batch)}


def _long4x() -> Scale:
    long = _long()
    # steps_factors (1,): the steps suite's one point here is the base run itself.
    return dataclasses.replace(long, name="long4x", base=apply_overrides(long.base, steps_overrides(long, 4)),
                               seeds=3, verdict_seeds=5, depths=(2, 8, 16), horizons=(0.25, 1.0),
                               step_factors=(1,), tuned=True)


def _smoke4x() -> Scale:
    """``long4x`` in miniature, for the tests: the smoke run in 4x the steps, every arm tuned."""
    smoke = _smoke()
    return dataclasses.replace(smoke, name="smoke4x", base=apply_overrides(smoke.base, steps_overrides(smoke, 4)),
                               verdict_seeds=2, depths=(2, 4), horizons=(0.5, 1.0), step_factors=(1,), tuned=True)


SCALES = {"smoke": _smoke, "smoke4x": _smoke4x, "cpu": _cpu, "gpu": _gpu, "long": _long, "long4x": _long4x}
"""Scale name -> a function returning the :class:`Scale`."""


def get_scale(name: str, *, seeds: int | None = None) -> Scale:
    """The scale ``name`` (``seeds`` replaces its seed count); a UserError for an unknown name, a ValueError
    for bad seeds."""
    if name not in SCALES:
        raise UserError(f"Invalid scale: {name!r} (expected one of {', '.join(SCALES)})")
    if seeds is not None and (isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1):
        raise ValueError(f"Invalid seeds: {seeds!r} (must be an integer >= 1)")
    scale = SCALES[name]()
    if seeds is not None:
        scale = dataclasses.replace(scale, seeds=seeds)
    return scale
