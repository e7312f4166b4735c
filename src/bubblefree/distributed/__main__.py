"""``torchrun --nproc-per-node P [--nnodes N ...] -m bubblefree.distributed [--preset NAME] [--config F]
[--set K=V ...] --out DIR``, and ``... -m bubblefree.distributed --resume DIR [--set K=V ...]``.

One process per stage (and replica); every rank runs the training loop, global rank 0 writes the run folder.
``--resume`` reads the run's own config.toml on every rank (so a multi-node resume needs the run folder on a
filesystem all nodes share), like ``bubblefree train --resume``; ``--resume --out DIR`` is the same as
``--resume DIR``. Failures end the process with the exit codes of ``bubblefree train``
(``bubblefree.errors.exit_code``): 2 invalid input, 3 a diverged run, 4 a filesystem that refused a write,
130 stopped by SIGINT or SIGTERM at a step boundary after a checkpoint, 1 a bug. The one-line messages of
the first three come from the first process of each node (``LOCAL_RANK`` 0) only: every rank knows them (the
ranks agree on failures at setup), so a failure is one line per node, not one per rank.
"""

from __future__ import annotations

import argparse
import os
import sys

from bubblefree.config import validate
from bubblefree.distributed.launch import exit_at_once, run_worker
from bubblefree.errors import FILESYSTEM_ERRNOS, FileSystemFault, TrainingDiverged, UserError, exit_code
from bubblefree.train.presets import run_dir, train_config

__all__: list[str] = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bubblefree.distributed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", default=None)
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                        help="continue the run in DIR (default: --out), or from DIR/checkpoints/step_N.pt")
    parser.add_argument("--branch", action="store_true", help="as bubblefree train --branch")
    parser.add_argument("--data-moved", action="store_true", help="as bubblefree train --data-moved")
    parser.add_argument("--accept-damaged", action="store_true", help="as bubblefree train --accept-damaged")
    args = parser.parse_args(argv)
    try:
        resume = args.resume if args.resume else args.out if args.resume == "" else None
        if args.resume == "" and args.out is None:
            raise UserError("Invalid --resume: name the run folder (--resume DIR)")
        if resume is None and args.out is None:
            raise UserError("Invalid command: --out DIR is required for a new run")
        config = train_config(args.preset, args.config, args.overrides, resume, accept_damaged=args.accept_damaged)
        config.pipeline.runtime = "distributed"
        validate(config, replicas=int(os.environ.get("WORLD_SIZE", config.pipeline.stages)) // config.pipeline.stages)
        out_dir = run_dir(resume) if resume is not None else args.out
        if resume is not None and args.out is not None and os.path.abspath(args.out) != os.path.abspath(out_dir):
            raise UserError(f"Invalid --out: {args.out} (a resumed run writes to its own folder {out_dir})")
        run_worker(config, out_dir=out_dir, resume=resume if resume and resume.endswith(".pt") else
                   resume is not None, branch=args.branch, data_moved=args.data_moved,
                   accept_damaged=args.accept_damaged)
    except (Exception, KeyboardInterrupt) as e:
        # Every rank knows a user error, a divergence or a stop: the first process of each node says it.
        speaks = os.environ.get("LOCAL_RANK", "0") == "0" or exit_code_of(e) == 1
        exit_at_once(exit_code(e) if speaks else exit_code_of(e))
    return 0


def exit_code_of(e: BaseException) -> int:
    """The exit code :func:`~bubblefree.errors.exit_code` gives ``e``, without printing (ranks other than 0)."""
    if isinstance(e, UserError):
        return 2
    if isinstance(e, KeyboardInterrupt):
        return 130
    if isinstance(e, FileSystemFault) or (isinstance(e, OSError) and e.errno in FILESYSTEM_ERRNOS):
        return 4
    return 3 if isinstance(e, TrainingDiverged) else 1


if __name__ == "__main__":
    sys.exit(main())
