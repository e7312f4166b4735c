"""``torchrun --nproc-per-node P [--nnodes N ...] -m bubblefree.distributed [--preset NAME] [--config F]
[--set K=V ...] --out DIR [--resume]``.

One process per stage (and replica); every rank runs the training loop, global rank 0 writes the run folder.
Invalid input is one line on stderr and exit code 2, as with ``bubblefree train``.
"""

from __future__ import annotations

import argparse
import sys

from bubblefree.distributed.launch import run_worker
from bubblefree.errors import UserError
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
    except UserError as e:
        print(f"bubblefree: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
