"""``torchrun --nproc-per-node P [--nnodes N ...] -m bubblefree.distributed [--preset NAME] [--config F]
[--set K=V ...] --out DIR``, and ``... -m bubblefree.distributed --resume DIR [--set K=V ...]``.

Every process runs ``bubblefree train`` with these options (its parser, checks and exit codes, the CLI's
own: ``bubblefree.cli``) on the distributed runtime, whatever the config says of ``pipeline.runtime``: one
process per stage (and replica), global rank 0 writing the run folder. ``--resume`` reads the run's own
config.toml on every rank (so a multi-node resume needs the run folder on a filesystem all nodes share).
Failures end every process with the exit codes of ``bubblefree train`` (2 invalid input, 3 a diverged run, 4 a
filesystem that refused a write, 130 stopped by SIGINT or SIGTERM at a step boundary after a checkpoint, 1 a
bug); their one-line messages come from the first process of each node (``LOCAL_RANK`` 0) only: every rank
knows them (the ranks agree on failures at setup), so a failure is one line per node, not one per rank.
"""

import sys

from bubblefree.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    # The runtime last, so that it wins over a --set of the user's; a layout key, so a resume may set it.
    sys.argv[1:] = ["train", *sys.argv[1:], "--set", "pipeline.runtime=distributed"]
    sys.exit(main())
