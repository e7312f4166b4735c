"""The ``bubblefree`` command (docs/training.md, docs/schedules.md, docs/throughput.md, docs/results.md).

    bubblefree train [--preset NAME] [--config FILE.toml] [--set KEY=VALUE ...] [--out DIR]
                     [--resume DIR | --resume DIR/checkpoints/step_NNNNNNNN.pt [--branch]] [--data-moved]
                     [--accept-damaged]
    bubblefree simulate --stages P --microbatches M --schedules a,b,... [--costs F:B:W[:U]] [--steps T] [--out DIR]
    bubblefree plan [--preset NAME] [--config FILE.toml] [--set KEY=VALUE ...] [--replicas R]
                    [--schedules a,b,...] [--costs F:B:W[:U]] [--steps T] [--out DIR]
    bubblefree bench {train,optim,delay,pipeline,time-to-loss,device} [--out DIR] [--tiny] [--point K] [--seeds N]
    bubblefree reproduce SUITE [--scale smoke|smoke4x|cpu|long|long4x|gpu] [--out DIR] [--seeds N]
                         [--optimizers A,B,...] [--config FILE.toml] [--set KEY=VALUE ...] [--report | --dry-run]
    bubblefree export RUN_OR_CHECKPOINT --format hf --out DIR

Exit codes: 0 success; 2 invalid input (one line on stderr naming the problem, nothing written or
overwritten; a run folder another process writes is invalid input too); 1 an internal failure (with its
traceback); 3 training diverged (a non-finite loss or gradient norm, or a final validation loss that is not
finite: one line naming the step and the last good checkpoint); 4 the filesystem refused a write (read-only,
full, a name too long: one line naming the file and the last good checkpoint); 130 interrupted (after a
checkpoint when one could be taken; SIGTERM alike). docs/reliability.md lists the cases and their messages.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from bubblefree import __version__, interrupts
from bubblefree.errors import TrainingDiverged, UserError, exit_code, naming
from bubblefree.schedules.ir import SIMULATED_SCHEDULES

# Each command imports what it runs inside its function: torch alone takes two seconds to import, which
# `bubblefree --help` and a rejected argument should not wait for.
__all__ = ["BENCHMARKS", "MAX_COST", "Number", "build_parser", "exit_code", "main", "number_options",
           "options_markdown"]

BENCHMARKS = {
    "train": "tokens/s of our model against Hugging Face's LlamaForCausalLM of the same shape, and MFU",
    "optim": "optimizer step time against each optimizer's reference implementation, state memory",
    "delay": "memory and step time that delay and Error Feedback add to a bare optimizer step",
    "pipeline": "the distributed runtime's throughput (GPipe, 1F1B, 2BW) against the schedule simulator",
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


def _parse_costs(text: str):
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

    export = commands.add_parser(
        "export", help="write a trained model as a Hugging Face folder (transformers loads it offline)",
        description="Export a run's newest checkpoint (or one checkpoint file) for other tools (docs/huggingface.md).")
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder or RUN/checkpoints/step_N.pt")
    export.add_argument("--format", choices=("hf",), default="hf",
                        help="hf: LLaMA config, safetensors weights, fast tokenizer (needs bubblefree[hf])")
    export.add_argument("--out", metavar="DIR", required=True, help="new folder to write (must not exist)")
    return parser


def _train(args: argparse.Namespace) -> int:
    from bubblefree.train.loop import train
    from bubblefree.train.presets import run_dir, train_config
    from bubblefree.train.resume import check_fresh_out_dir

    for flag, given in (("--branch", args.branch), ("--data-moved", args.data_moved),
                        ("--accept-damaged", args.accept_damaged)):
        if given and args.resume is None:
            raise UserError(f"Invalid {flag}: it goes with --resume (a new run has nothing to continue)")
    config = train_config(args.preset, args.config, args.overrides, args.resume, accept_damaged=args.accept_damaged)
    resume: bool | Path = args.resume is not None
    if resume:
        out_dir = run_dir(args.resume)
        if args.out is not None and Path(args.out).resolve() != out_dir.resolve():
            raise UserError(f"Invalid --out: {args.out} (a resumed run writes to its own folder {out_dir})")
        if Path(args.resume).suffix == ".pt":
            resume = Path(args.resume)
    else:
        out_dir = Path(args.out or f"runs/{args.preset or 'demo'}-{time.strftime('%Y%m%d-%H%M%S')}")
        check_fresh_out_dir(out_dir)
    options = {"resume": resume, "branch": args.branch, "data_moved": args.data_moved,
               "accept_damaged": args.accept_damaged}
    if config.pipeline.runtime == "distributed":
        # One process per stage; every rank runs this same training loop with the distributed executor.
        from bubblefree.distributed import launch_local, run_worker

        if "RANK" in os.environ:  # started by torchrun: this process is one rank
            from bubblefree.config import validate

            validate(config, replicas=int(os.environ["WORLD_SIZE"]) // config.pipeline.stages)
            run_worker(config, out_dir=out_dir, **options)
            if os.environ["RANK"] != "0":  # the run's verdict is said once, by the rank that wrote it
                return 0
        else:
            launch_local(config, out_dir, **options)
        from bubblefree.train.metrics import read_metrics  # the ranks' summary stays with them: read what they wrote

        evaluated = [r for r in read_metrics(out_dir / "metrics.jsonl") if "val_loss" in r]
        if evaluated:
            _check_usable(evaluated[-1]["val_loss"], evaluated[-1]["step"], config, out_dir)
        return 0
    summary = train(config, out_dir=out_dir, **options)
    _check_usable(summary["final_val_loss"], summary["steps"], config, out_dir)
    return 0


def _check_usable(final_val_loss: float, steps: int, config, out_dir: Path) -> None:
    """A run whose final validation loss is not finite did not end "done": exit 3 (TrainingDiverged)."""
    if not math.isfinite(final_val_loss):  # e.g. train.nonfinite = skip skipped (nearly) every batch
        skipped = " after skipping batches (train.nonfinite = skip)" if config.train.nonfinite == "skip" else ""
        raise TrainingDiverged(f"training ended at step {steps} with a final validation loss of "
                               f"{final_val_loss}{skipped}: the model is not usable; outputs in "
                               f"{shlex.quote(str(out_dir))}")


def _as_options(e: ValueError) -> UserError:
    """A library's refusal of a command-line value, naming the option as the user typed it: the schedule
    builders and the memory plan name their arguments (``Invalid stages: 0``), the user gave ``--stages``."""
    return UserError(re.sub(r"^Invalid (stages|microbatches|steps|replicas):", r"Invalid --\1:", str(e)))


def _simulate(args: argparse.Namespace) -> int:
    from bubblefree.schedules.ir import check_schedule
    from bubblefree.schedules.report import simulate_schedules

    costs = _parse_costs(args.costs)
    try:
        schedules = [name for name in args.schedules.split(",") if name]
        for name in schedules:  # check every name before printing anything
            check_schedule(name, args.stages, args.microbatches, steps=args.steps)  # building could take minutes
    except ValueError as e:
        raise _as_options(e) from None
    if args.out is not None:  # its own earlier output may be replaced, nothing else
        from bubblefree.train.folders import check_ours

        check_ours(Path(args.out), what="--out", ours=("timeline.png",), marker="simulate.json")
    simulate_schedules(schedules, stages=args.stages, microbatches=args.microbatches, costs=costs,
                       steps=args.steps, out=args.out)
    return 0


def _plan(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from bubblefree.train.memory import format_plan, plan_memory
    from bubblefree.train.presets import train_config

    config = train_config(args.preset, args.config, args.overrides, None)
    costs = _parse_costs(args.costs)
    try:
        schedules = [name for name in args.schedules.split(",") if name]
        unknown = [name for name in schedules if name not in SIMULATED_SCHEDULES]
        if unknown:
            raise ValueError(f"Invalid schedule: {unknown[0]!r} (choose from {', '.join(SIMULATED_SCHEDULES)})")
        rows = plan_memory(config, replicas=args.replicas, schedules=schedules, costs=costs, steps=args.steps)
    except ValueError as e:
        raise _as_options(e) from None
    t, p = config.train, config.pipeline
    model = config.model.init_from or config.model.preset
    print(f"{model}, {config.optim.name}, correction {config.delay.correction}, batch {t.batch_size} "
          f"= {p.microbatches} x {t.batch_size // p.microbatches} sequences of {t.seq_len} tokens, "
          f"{'bfloat16' if t.dtype == 'bfloat16' else 'float32'} activations, P = {p.stages}, R = {args.replicas};"
          f" step time in units of --costs {args.costs} (one microbatch's forward on one stage = "
          f"{costs.forward:g})")
    print(format_plan(rows))
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        records = [{**row, "stages": [{**dataclasses.asdict(st), "total": st.total} for st in row["stages"]]}
                   if "stages" in row else row for row in rows]
        with naming(out / "plan.json"):
            (out / "plan.json").write_text(json.dumps(records, indent=1) + "\n")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.tiny and args.name != "device":
        raise UserError(f"Invalid --tiny: only 'bench device' takes it, not 'bench {args.name}'")
    for option, value in (("--point", args.point), ("--seeds", args.seeds)):
        if value is not None and args.name != "time-to-loss":
            raise UserError(f"Invalid {option}: only 'bench time-to-loss' takes it, not 'bench {args.name}'")
    if args.name == "device":  # exit 1 when a part failed, after writing every part's record
        from bubblefree.bench.device import run as device_check

        parts = device_check(args.out, tiny=args.tiny)["parts"].values()
        return 0 if all(p["status"] == "ok" for p in parts) else 1
    try:
        module = importlib.import_module(f"bubblefree.bench.{args.name.replace('-', '_')}")
    except ModuleNotFoundError as e:
        if e.name != f"bubblefree.bench.{args.name.replace('-', '_')}":
            raise
        raise UserError(f"Invalid benchmark: {args.name!r} is not available in this build") from None
    # --point is a point of the long scale's steps suite (bubblefree.bench.time_to_loss has every option).
    point = {} if args.point is None else {"scale": "long", "point": args.point}
    seeds = {} if args.seeds is None else {"seeds": args.seeds}
    module.run(out=Path(args.out) if args.out else None, **point, **seeds)
    return 0


def _export(args: argparse.Namespace) -> int:
    from bubblefree.export import export_hf

    out = export_hf(args.source, args.out)
    print(f"bubblefree: exported {args.source} to {out} (transformers: AutoModelForCausalLM.from_pretrained"
          f"({str(out)!r}), AutoTokenizer.from_pretrained({str(out)!r}))")
    return 0


def _relative(path: str | None) -> str | None:
    """``path`` as written in a suite's committed table: relative to the working directory when it lies below
    it, so a results file names no folder of the machine that made it."""
    if path is None or not os.path.isabs(path):
        return path
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def _reproduce(args: argparse.Namespace) -> int:
    from bubblefree.experiments import reproduce
    from bubblefree.experiments.reproduce import dry_run, report

    if args.report and args.dry_run:
        raise UserError("Invalid options: --dry-run with --report (choose one)")
    if args.report:  # the suite's own record says how it ran: run-shaping options would be ignored, so refuse them
        given = [f"--{k}" for k in ("seeds", "optimizers", "jobs", "config") if getattr(args, k) is not None]
        if given or args.overrides:
            raise UserError(f"Invalid options with --report: {', '.join(given + ['--set'] * bool(args.overrides))}"
                            f" (the report uses the settings the suite ran with)")
        out = args.out or f"results/{args.scale}"
        result = report(out, args.suite, command=f"bubblefree reproduce {args.suite} --report --out {_relative(out)}")
        print(f"bubblefree: {args.suite}: table {result['table']}; plots "
              f"{', '.join(str(p) for p in result['plots']) or 'none'} (from the runs finished so far)")
        return 0
    optimizers = tuple(o for o in args.optimizers.split(",") if o) if args.optimizers else None
    if args.dry_run:
        got = dry_run(args.suite, scale=args.scale, out=args.out, seeds=args.seeds, optimizers=optimizers,
                   jobs=args.jobs, config_file=args.config, overrides=args.overrides)
        todo, at_once = got["to_run"], min(got["jobs"], max(1, len(got["to_run"])))
        print(f"bubblefree: {args.suite} ({args.scale}): {got['finished']} run(s) finished, at least {len(todo)} to "
              f"run (a sweep still to run may extend past its grid)")
        if todo and got["untimed"] == len(todo):
            print("  no finished run in this results folder has their shape to time them by")
        elif todo:
            untimed = f"; {got['untimed']} run(s) of a shape never run here, not counted" if got["untimed"] else ""
            print(f"  about {got['minutes']:.0f} core-minutes, {got['minutes'] / at_once:.0f} minutes at --jobs "
                  f"{at_once} (each run at the median time of the finished runs of its shape){untimed}")
        if todo:
            print(f"  next: {todo[0]}")
        return 0
    command = " ".join(["bubblefree reproduce", args.suite, "--scale", args.scale]
                       + [f"--{k} {v}" for k, v in (("out", _relative(args.out)), ("seeds", args.seeds),
                                                   ("optimizers", args.optimizers), ("jobs", args.jobs),
                                                   ("config", args.config)) if v is not None]
                       + [f"--set {text}" for text in args.overrides])
    result = reproduce(args.suite, scale=args.scale, out=args.out, seeds=args.seeds, optimizers=optimizers,
                       command=command, jobs=args.jobs, config_file=args.config, overrides=args.overrides)
    print(f"bubblefree: {args.suite}: table {result['table']}; plots "
          f"{', '.join(str(p) for p in result['plots']) or 'none'}; chosen learning rates "
          f"{', '.join(f'{o} {lr:g}' for o, lr in result['lrs'].items())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code. Without ``argv`` this is the program (the console script,
    ``python -m bubblefree``, and every rank of ``torchrun -m bubblefree.distributed``), which ends when it
    returns (at once, with its code, where that is not 0): SIGINT and SIGTERM are left ignored then, so nothing
    after the command's outcome can change its exit code (``bubblefree.interrupts``); a caller in the same
    process (with ``argv``) gets its own handlers back."""
    with interrupts.command(program=argv is None):  # SIGTERM as Ctrl-C, from here to the process's exit: 130
        try:
            try:
                parser = build_parser()
                args = parser.parse_args(argv)
                for number in number_options(parser)[args.command]:  # ranges first (docs/reliability.md)
                    number.check(getattr(args, number.dest))
                code = {"train": _train, "simulate": _simulate, "plan": _plan, "bench": _bench,
                        "reproduce": _reproduce, "export": _export}[args.command](args)
            finally:
                interrupts.settle()  # the outcome is known: a signal from here on changes nothing
        except (Exception, KeyboardInterrupt) as e:
            # Under torchrun every rank runs this command and knows the same failure: each node's first says it.
            code = exit_code(e, say=os.environ.get("LOCAL_RANK", "0") == "0")
        if code == 0 and interrupts.signalled():  # too late to stop anything, yet the shell was asked to stop
            print("bubblefree: interrupted after the command had done its work (nothing is missing)",
                  file=sys.stderr, flush=True)
            code = 130
    if code != 0 and argv is None:
        # A failed or stopped program ends here with its own code, its output flushed and its files closed,
        # without the interpreter's teardown: CPython ends a process by SIGINT, whatever code it returns, once a
        # KeyboardInterrupt has passed through code it exec'd (the methods dataclasses generate: measured, one
        # run in four of a storm of signals during torch's import), and a rank under torchrun whose gloo
        # threads still run after a failure aborts in their teardown (SIGABRT instead of its code).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
