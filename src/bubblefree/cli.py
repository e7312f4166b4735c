"""The ``bubblefree`` command (docs/training.md, docs/schedules.md, docs/throughput.md, docs/results.md).

    bubblefree train [--preset NAME] [--config FILE.toml] [--set KEY=VALUE ...] [--out DIR]
                     [--resume DIR | --resume DIR/checkpoints/step_NNNNNNNN.pt [--branch]] [--data-moved]
                     [--accept-damaged]
    bubblefree simulate --stages P --microbatches M --schedules a,b,... [--costs F:B:W[:U]] [--steps T] [--out DIR]
    bubblefree plan [--preset NAME] [--config FILE.toml] [--set KEY=VALUE ...] [--replicas R]
                    [--schedules a,b,...] [--costs F:B:W[:U]] [--steps T] [--out DIR]
    bubblefree bench {train,optim,delay,pipeline,depth,time-to-loss,device} [--out DIR] [--tiny] [--point K] [--seeds N]
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
from pathlib import Path

from bubblefree import interrupts
from bubblefree.commandline import build_parser, number_options, parse_costs
from bubblefree.errors import TrainingDiverged, UserError, exit_code, naming

# Each command imports what it runs inside its function: torch alone takes two seconds to import, which
# `bubblefree --help` and a rejected argument should not wait for.
__all__ = ["main"]


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

    costs = parse_costs(args.costs)
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

    from bubblefree.schedules.ir import SIMULATED_SCHEDULES
    from bubblefree.train.memory import format_plan, plan_memory
    from bubblefree.train.presets import train_config

    config = train_config(args.preset, args.config, args.overrides, None)
    costs = parse_costs(args.costs)
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
