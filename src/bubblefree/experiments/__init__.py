"""The paper's experiments (arXiv 2606.30634) as suites of runs: ``bubblefree reproduce SUITE``.

``reproduce(suite, scale=...)`` sweeps the learning rate, runs the suite (one JSON per run, finished runs
skipped), and writes a markdown table laid out like the paper's and PNG plots; see docs/results.md.
"""

from bubblefree.experiments.reproduce import reproduce
from bubblefree.experiments.runner import Run, run_all, run_id
from bubblefree.experiments.scales import SCALES, Scale, get_scale
from bubblefree.experiments.suites import SUITES, Suite, get_suite

__all__ = ["SCALES", "SUITES", "Run", "Scale", "Suite", "get_scale", "get_suite", "reproduce", "run_all", "run_id"]
