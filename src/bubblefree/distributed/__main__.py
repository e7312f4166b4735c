"""``torchrun --nproc-per-node P [--nnodes N ...] -m bubblefree.distributed [--preset NAME] [--config F]
[--set K=V ...] --out DIR [--resume]``.

One process per stage (and replica); every rank runs the training loop, global rank 0 writes the run folder.
Failures end the process with the exit codes of ``bubblefree train`` (``bubblefree.cli.exit_code``): 2 invalid
input, 3 a diverged run, 1 a bug.
"""

from __future__ import annotations

import argparse
import sys

from bubblefree.cli import exit_code
from bubblefree.distributed.launch import exit_at_once, run_worker
from bubblefree.train.config import load_config

__all__: list[str] = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bubblefree.distributed", description=__doc__)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.preset, args.config, args.overrides)
        config.pipeline.runtime = "distributed"
        run_worker(config, out_dir=args.out, resume=args.resume)
    except (Exception, KeyboardInterrupt) as e:
        exit_at_once(exit_code(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
