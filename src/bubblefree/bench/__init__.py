"""Benchmarks: each module has ``run(out: Path | None = None) -> dict`` that prints a side-by-side table;
``synthetic`` holds the fixed-cost pipeline stages the pipeline benchmarks run."""
