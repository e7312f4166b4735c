"""Benchmarks: each module has ``run(out: Path | None = None) -> dict`` that prints a side-by-side table."""
