"""``torchrun --nproc-per-node P [--nnodes N ...] -m bubblefree.distributed [--config F] [--set K=V ...] --out DIR``.

One process per stage (and replica); rank 0 runs the training loop and writes the run folder.
"""

from __future__ import annotations

import argparse

from bubblefree.distributed.launch import run_worker
from bubblefree.train.config import load_config

__all__: list[str] = []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bubblefree.distributed", description=__doc__)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    config = load_config(args.preset, args.config, args.overrides)
    config.pipeline.runtime = "distributed"
    run_worker(config, out_dir=args.out, resume=args.resume)


if __name__ == "__main__":
    main()
