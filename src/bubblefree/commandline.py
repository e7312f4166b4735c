"""The ``bubblefree`` command line's grammar: its commands, their options and every number's range
(docs/reliability.md, "Ranges"). ``bubblefree.cli`` runs what it parses.

Nothing here imports torch: ``bubblefree --help`` and a refused argument answer at once.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from typing import NoReturn

from bubblefree import __version__
from bubblefree.errors import UserError
from bubblefree.schedules.ir import SIMULATED_SCHEDULES

__all__ = ["BENCHMARKS", "MAX_COST", "Number", "build_parser", "number_options", "options_markdown", "parse_costs"]

BENCHMARKS = {
    "train": "tokens/s of our model against Hugging Face's LlamaForCausalLM of the same shape, and MFU",
    "optim": "optimizer step time against each optimizer's reference implementation, state memory",
    "delay": "memory and step time that delay and Error Feedback add to a bare optimizer step",
    "pipeline": "the distributed runtime's throughput (GPipe, 1F1B, 2BW) against the schedule simulator",
    "depth": "the schedules on paper at P = 4-32, M = P-4P, from a block's measured F, B, W and update times",
    "time-to-loss": "wall-clock for 2BW + Error Feedback to reach synchronous 1F1B's final validation loss",
    "device": "the accelerator check: parity against float64, ours against HF eager and compiled, "
              "optimizers on CUDA, sync/2BW/EF quality (GPU; --tiny on the CPU)",
}
"""Benchmark name -> what it measures (docs/throughput.md and the modules of ``bubblefree.bench``)."""


class _Parser(argparse.ArgumentParser):
    """argparse, refusing in one line like every other refusal (``bubblefree: error: ...``, exit code 2); the
    usage is a ``--help`` away."""

    def error(self, message: str) -> NoReturn:
        ours = re.sub(r"^argument [^:]+: (?=Invalid )", "", message)  # a Number names its option and range itself
        self.exit(2, f"bubblefree: error: {ours if ours != message else f'{message}; see {self.prog} --help'}\n")


def _cores() -> int:
    """The cores this process may use (its CPU affinity, which a container or ``taskset`` narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Number:
    """The argparse ``type`` of a number option, with its range ``[lo, hi]`` (``hi`` may be a function of the
    machine, e.g. :func:`_cores`; ``why`` says where ``hi`` comes from). It parses the text (a non-number is
    refused in one line naming the option and the range); :func:`main` checks the range after parsing, so that
    ``--help`` and the documented commands parse on any machine."""

    def __init__(self, flag: str, kind: type, lo: float, hi: float | Callable[[], float], why: str = "") -> None:
        self.flag, self.kind, self.lo, self.hi, self.why = flag, kind, lo, hi, why

    @property
    def high(self) -> float:
        return self.hi() if callable(self.hi) else self.hi

    def __str__(self) -> str:
        """``an integer in [1, 1024]``, and the reason of the bound, if any (here: ``[1, 2]: the cores ...``)."""
        return f"{self._what} in [{self.lo}, {self.high}]" + (f": {self.why}" if self.why else "")

    @property
    def rule(self) -> str:
        """The range as the docs state it, the same on every machine: ``an integer >= 1 and at most the cores
        ...`` where the bound is the machine's."""
        return f"{self._what} >= {self.lo} and at most {self.why}" if callable(self.hi) else str(self)

    @property
    def _what(self) -> str:
        return "an integer" if self.kind is int else "a finite number"

    def __call__(self, text: str) -> float:
        try:
            return self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"Invalid {self.flag}: {text!r} (must be {self})") from None

    @property
    def dest(self) -> str:
        """The option's attribute in the parsed arguments."""
        return self.flag.lstrip("-").replace("-", "_")

    def check(self, value: float | None) -> None:
        """Refuse a given value outside the range, in one line (a UserError)."""
        if value is not None and not (math.isfinite(value) and self.lo <= value <= self.high):
            raise UserError(f"Invalid {self.flag}: {value} (must be {self})")


# The simulator's sizes: far past the pipelines in use (a hundred or so stages at most, hundreds of
# microbatches), so no real question is refused, while every count stays a small machine integer. What a
# request inside them costs is the simulator's concern, not a range's.
_STAGES, _MICROBATCHES, _STEPS = 1024, 65536, 10000
_SEEDS = 100
"""The most seeds of one configuration: the verdicts use up to 5 (docs/results.md), and each seed is a whole
run of every arm of the suite."""
MAX_COST = 1e12
"""The largest time of ``--costs`` (in any unit: nanoseconds of a 15-minute step fit): every sum the simulator
forms over a run within the bounds above then stays a finite float."""
_COST_RULE = "each a finite number in [0, 1e12], F + B + W above zero"


def number_options(parser: argparse.ArgumentParser) -> dict[str, list[Number]]:
    """``{command: [its number options]}``: the options whose type is a :class:`Number`."""
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: [a.type for a in sub._actions if isinstance(a.type, Number)]
            for name, sub in commands.choices.items()}


def options_markdown() -> str:
    """The table of number options in docs/reliability.md, from :func:`number_options`."""
    out = ["| command | option | must be |", "|---|---|---|"]
    for command, numbers in number_options(build_parser()).items():
        out += [f"| `{command}` | `{n.flag}` | {n.rule} |" for n in numbers]
    out.append(f"| `simulate`, `plan` | `--costs F:B:W[:U]` | {_COST_RULE} |")
    return "\n".join(out) + "\n"


def parse_costs(text: str):
    """``--costs`` as ``schedules.timeline.Costs``, each time finite and within ``[0, MAX_COST]``."""
    from bubblefree.schedules.timeline import Costs

    parts, rule = text.split(":"), _COST_RULE
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (3, 4) or len(parts) != len(values):
        raise UserError(f"Invalid --costs: {text!r} (expected F:B:W or F:B:W:U, e.g. 1:1:1; {rule})")
    if not all(math.isfinite(v) and 0 <= v <= MAX_COST for v in values) or sum(values[:3]) <= 0:
        raise UserError(f"Invalid --costs: {text!r} ({rule})")
    return Costs.parse(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bubblefree",
        description="Asynchronous pipeline-parallel LLM pretraining (PipeDream-2BW, PipeDream) with "
                    "delay-robust optimizers and Error Feedback (arXiv 2606.30634).")
    parser.add_argument("--version", action="version", version=f"bubblefree {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _train_command(commands)
    _simulate_command(commands)
    _plan_command(commands)
    _bench_command(commands)
    _reproduce_command(commands)
    _export_command(commands)
    return parser


def _train_command(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train", help="train a model (bare: the paper's recipe on the embedded corpus, about 2 minutes on 2 idle "
                      "CPU cores, 12.5 at load 11-14; --preset smoke: 4-11 s)",
        description="Train a model. Configuration precedence: preset < --config < --set.")
    train.add_argument("--preset", metavar="NAME", help="run preset (default: demo); see docs/training.md")
    train.add_argument("--config", metavar="FILE.toml", help="TOML file with [section] tables of keys")
    train.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                       help="override one key, e.g. --set optim.lr=3e-4 (repeatable)")
    train.add_argument("--out", metavar="DIR", help="output folder (default: runs/<preset>-<time>); "
                                                    "must not already hold a run")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint, "
                                                       "or from the checkpoint file DIR/checkpoints/step_N.pt")
    train.add_argument("--branch", action="store_true",
                       help="with --resume of an older checkpoint: continue from it although the run went on; "
                            "its newer checkpoints and a copy of metrics.jsonl are moved to DIR/superseded/ "
                            "(nothing is deleted)")
    train.add_argument("--data-moved", action="store_true",
                       help="with --resume: continue on data at another path (a new data.source may be set) "
                            "whose tokens are the run's own (checked)")
    train.add_argument("--accept-damaged", action="store_true",
                       help="with --resume: go on although the run's config.toml, data.json, metrics.jsonl or "
                            "checkpoint manifest is missing or damaged (refused without it); each damaged file "
                            "is kept beside its replacement as NAME.damaged-<time>")


def _simulate_command(commands: argparse._SubParsersAction) -> None:
    simulate = commands.add_parser(
        "simulate", help="compare pipeline schedules on paper: bubbles, delays, memory, timeline pictures",
        description="Simulate pipeline schedules from their action orders (see docs/schedules.md).")
    simulate.add_argument("--stages", type=Number("--stages", int, 1, _STAGES), required=True, metavar="P")
    simulate.add_argument("--microbatches", type=Number("--microbatches", int, 1, _MICROBATCHES), required=True,
                          metavar="M", help="per optimizer step")
    simulate.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zero-bubble,2bw,pipedream",
                          metavar="A,B,...", help="comma-separated (default: all)")
    simulate.add_argument("--costs", default="1:1:1", metavar="F:B:W[:U]",
                          help="forward, input-gradient, weight-gradient and optional optimizer-update times "
                               "(default 1:1:1)")
    simulate.add_argument("--steps", type=Number("--steps", int, 1, _STEPS), default=8, metavar="T",
                          help="optimizer steps (default 8)")
    simulate.add_argument("--out", metavar="DIR", help="write timeline.png and simulate.json here (a new or empty "
                                                         "folder, or one of an earlier simulate)")


def _plan_command(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan", help="memory per pipeline stage in bytes for every schedule, beside step time and bubble",
        description="Plan a run's memory before it starts: per stage, the bytes of parameters, stashed weight "
                    "versions, gradients, optimizer state, update buffers, correction buffers and activations "
                    "in flight, for every schedule (docs/memory.md). Takes a run's configuration like train.")
    plan.add_argument("--preset", metavar="NAME", help="run preset (default: demo); see docs/training.md")
    plan.add_argument("--config", metavar="FILE.toml", help="TOML file with [section] tables of keys")
    plan.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                      help="override one key, e.g. --set model.preset=smollm2-135m (repeatable)")
    plan.add_argument("--replicas", type=Number("--replicas", int, 1, _MICROBATCHES), default=1, metavar="R",
                      help="data-parallel replicas, splitting pipeline.microbatches (default 1)")
    plan.add_argument("--schedules", default=",".join(SIMULATED_SCHEDULES), metavar="A,B,...",
                      help="comma-separated (default: all)")
    plan.add_argument("--costs", default="1:1:1", metavar="F:B:W[:U]", help="as for simulate (default 1:1:1)")
    plan.add_argument("--steps", type=Number("--steps", int, 1, _STEPS), default=8, metavar="T",
                      help="optimizer steps simulated (default 8)")
    plan.add_argument("--out", metavar="DIR", help="also write plan.json here")


def _bench_command(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench", help="run a benchmark and print a side-by-side table",
        description="Run a benchmark and print a side-by-side table (docs/throughput.md).",
        epilog="benchmarks:\n" + "\n".join(f"  {name:<13} {what}" for name, what in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("name", choices=tuple(BENCHMARKS), metavar="NAME", help=", ".join(BENCHMARKS))
    bench.add_argument("--out", metavar="DIR", help="also write the results here")
    bench.add_argument("--tiny", action="store_true",
                       help="device only: run the accelerator check on the CPU with tiny sizes")
    bench.add_argument("--point", type=Number("--point", int, 1, _STEPS), metavar="K",
                       help="time-to-loss only: the long scale's steps-suite point K (the same tokens in K times "
                            "the steps), each schedule at the rate its arm chose on the suite's sweep")
    bench.add_argument("--seeds", type=Number("--seeds", int, 1, _SEEDS), metavar="N",
                       help="time-to-loss only: seeds per schedule (default 1)")


def _reproduce_command(commands: argparse._SubParsersAction) -> None:
    reproduce = commands.add_parser(
        "reproduce", help="run one of the paper's experiments: runs, a table beside the paper's, plots",
        description="Reproduce an experiment of arXiv 2606.30634 (see docs/results.md). Finished runs are "
                    "skipped, so an interrupted suite continues where it stopped.")
    reproduce.add_argument("suite", metavar="SUITE", help="optimizers, error-feedback, momentum, mitigations, "
                                                          "schedules, sensitivity, moe, horizon or steps")
    reproduce.add_argument("--scale", choices=("smoke", "smoke4x", "cpu", "long", "long4x", "gpu"), default="cpu",
                           help="smoke: minutes; cpu (default): 38 min for optimizers on 2 cores; long: 20 tokens "
                                "per parameter, ~10 min per run on one core; long4x: the same tokens in 4x the "
                                "steps, every arm tuned, ~15 min per run; gpu: 135M runs")
    reproduce.add_argument("--out", metavar="DIR", help="results folder (default results/<scale>)")
    reproduce.add_argument("--seeds", type=Number("--seeds", int, 1, _SEEDS), metavar="N",
                           help="seeds per configuration (default: the scale's)")
    reproduce.add_argument("--optimizers", metavar="A,B,...", help="only these of the suite's optimizers")
    reproduce.add_argument("--jobs", type=Number("--jobs", int, 1, _cores, "the cores this process may use (more "
                                                "runs at once only take turns on them)"), metavar="N",
                           help="runs at once, one process each (default: one per core; 1 at --scale gpu)")
    reproduce.add_argument("--config", metavar="FILE.toml", help="keys that change the scale's base run, "
                                                                 "as [section] tables (your data, model, ...)")
    reproduce.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                           help="change one key of the scale's base run, e.g. --set data.source=my.txt "
                                "(repeatable; after --config); docs/results.md")
    reproduce.add_argument("--report", action="store_true",
                           help="run nothing: rewrite the table and plots from the runs finished so far "
                                "(a suite under way shows '-' for the rest)")
    reproduce.add_argument("--dry-run", action="store_true",
                           help="run nothing: count the runs still to come (at least: a sweep still to run may "
                                "extend past its grid) and time them by the finished runs of the same shape")


def _export_command(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export", help="write a trained model as a Hugging Face folder (transformers loads it offline)",
        description="Export a run's newest checkpoint (or one checkpoint file) for other tools (docs/huggingface.md).")
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder or RUN/checkpoints/step_N.pt")
    export.add_argument("--format", choices=("hf",), default="hf",
                        help="hf: LLaMA config, safetensors weights, fast tokenizer (needs bubblefree[hf])")
    export.add_argument("--out", metavar="DIR", required=True, help="new folder to write (must not exist)")
