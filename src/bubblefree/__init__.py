"""bubblefree: asynchronous pipeline-parallel LLM pretraining.

Importing bubblefree before torch sets ``OMP_WAIT_POLICY=PASSIVE`` (unless it is set already): OpenMP threads
that finish a kernel early then sleep instead of spinning for the core a straggler needs. On a busy machine the
spinning made the default run 2.8x slower (docs/training.md, "Threads"); on an idle one it changes nothing
measurable, and it never changes a result.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
