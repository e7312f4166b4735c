"""``python -m bubblefree.docs [--check]``: rewrite the generated parts of docs/ in place.

A generated part of a Markdown file sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` comments;
everything outside the markers is written by hand and left as it is. The parts:

* ``config-reference`` (docs/training.md): the configuration reference, from the config's field docstrings;
* ``optimizer-defaults`` (docs/optimizers.md): each optimizer's defaults, from ``optim.registry``;
* ``config-ranges`` (docs/reliability.md): the range of every number a config key takes, from ``config.RANGES``
  (the options' ranges beside it are checked by tests/test_ranges.py: the CLI is this module's layer);
* ``findings`` (docs/results.md): the findings table, every finding of the paper at 1200 and 4800 steps with its
  verdict, from the JSON under ``results/`` (``experiments.findings``);
* ``cell:ROW/COLUMN`` (README.md and any doc): one cell of the findings table quoted in prose, e.g.
  ``<!-- cell:muon-ef/4800 -->-0.003 [-0.017, 0.011] (3)<!-- /cell -->``: the figure is written by this command,
  so prose cannot drift from the table;
* ``results:FOLDER/SUITE`` (any file): the learning-rate sweep and the table of ``bubblefree reproduce
  SUITE``, rebuilt from the JSON under ``results/FOLDER`` (``experiments.reproduce.tables``): the same text
  as that folder's ``SUITE.md``, with ``####`` headings. A suite still under way (its record is written once
  its rates are chosen) shows ``-`` for the runs to come and says how many there are, so a study that spans
  sessions is tabulated from whatever has been committed. Only results folders kept in the repository can
  back such a part.

``--check`` rewrites nothing and exits 1 when a part or a quoted cell is out of date (an edited figure), when a
suite's own table under results/ (``results/FOLDER/SUITE.md``, written by ``bubblefree reproduce SUITE --report``)
no longer holds the tables its runs' JSON give (:func:`stale_results`), when a figure with its interval is typed
by hand in the prose of README.md or docs/results.md (the report: it quotes cells), or when one in another doc's
prose (``0.063 [0.050, 0.075]``, outside code and generated parts) is in no table under results/
(:func:`unbacked_intervals`: the log's readings of the day stay the ones the runs give). A test runs the same
comparisons. This is a tool for a source checkout: it finds docs/ and results/ next to ``src/``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from bubblefree.bench.depth import depth_markdown
from bubblefree.config import ranges_markdown, reference_markdown
from bubblefree.experiments.findings import cells, findings_markdown
from bubblefree.experiments.reproduce import tables
from bubblefree.optim.registry import defaults_markdown

__all__ = ["PARTS", "generate", "main", "splice", "stale_results", "unbacked_intervals"]

ROOT = Path(__file__).resolve().parents[2]
DOCS, RESULTS = ROOT / "docs", ROOT / "results"
_RESULTS_PART = re.compile(r"<!-- (results:([\w.-]+)/([\w-]+)):begin -->")
_NUMBER = r"-?\d+(?:\.\d+)?(?:\s+%)?"
_INTERVAL = re.compile(rf"{_NUMBER}\s+\[{_NUMBER},\s+{_NUMBER}\]")
"""A figure and its interval as the tables write them: ``0.063 [0.050, 0.075]``, ``53 % [48 %, 57 %]``."""
_CELL = re.compile(r"(<!-- cell:([\w.-]+/[\w.-]+) -->)(.*?)(<!-- /cell -->)", re.S)
"""A quoted cell of the findings table: its marker, name, figure and closing marker."""
_NOT_PROSE = re.compile(r"```.*?```|`[^`\n]*`|<!-- ([\w:/.-]+):begin -->.*?<!-- \1:end -->"
                        r"|<!-- cell:[^>]*-->.*?<!-- /cell -->", re.S)
"""Not prose: fenced and inline code, generated parts, quoted cells."""
_REPORTS = ("README.md", "docs/results.md")
"""The pages whose prose quotes figures only through cells."""

PARTS: dict[str, tuple[str, Callable[[Path], str]]] = {
    "config-reference": ("training.md", lambda results: reference_markdown()),
    "optimizer-defaults": ("optimizers.md", lambda results: defaults_markdown()),
    "findings": ("results.md", findings_markdown),
    "config-ranges": ("reliability.md", lambda results: ranges_markdown()),
    "depth-table": ("throughput.md", lambda results: depth_markdown(**json.loads(
        (results / "bench" / "depth" / "depth.json").read_text(encoding="utf-8")))),
}
"""``{part name: (file under docs/, the function that writes the part from the results folder)}``."""


def splice(text: str, name: str, content: str) -> str:
    """``text`` with the part ``name`` replaced by ``content`` (the markers stay); a ValueError if it has none."""
    pattern = re.compile(rf"(<!-- {re.escape(name)}:begin -->\n)(.*?)(<!-- {re.escape(name)}:end -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated part {name!r} (<!-- {name}:begin --> ... <!-- {name}:end -->)")
    return pattern.sub(lambda m: m.group(1) + content.rstrip("\n") + "\n" + m.group(3), text, count=1)


def generate(docs: Path = DOCS, results: Path = RESULTS) -> dict[Path, str]:
    """The new text of every file under ``docs`` that holds generated parts (``results`` backs the
    ``results:`` parts)."""
    out: dict[Path, str] = {}
    for name, (file, write) in PARTS.items():
        path = docs / file
        out[path] = splice(out.get(path, path.read_text(encoding="utf-8")), name, write(results))
    quoted = cells(results)
    readme = docs.parent / "README.md"
    for path in [*([readme] if readme.exists() else []), *sorted(docs.glob("*.md"))]:
        text = out.get(path, path.read_text(encoding="utf-8"))
        for name, folder, suite in _RESULTS_PART.findall(text):
            text = splice(text, name, tables(results / folder, suite, heading="####", partial=True))
        text = _CELL.sub(lambda m, path=path: m.group(1) + _quote(quoted, m.group(2), path) + m.group(4), text)
        if path in out or _RESULTS_PART.search(text) or _CELL.search(text):
            out[path] = text
    return out


def _quote(quoted: dict[str, str], name: str, path: Path) -> str:
    if name not in quoted:
        raise ValueError(f"{path.name}: no cell {name!r} in the findings table (experiments.findings)")
    return quoted[name]


def stale_results(results: Path = RESULTS) -> list[str]:
    """One line per ``results/FOLDER/SUITE.md`` whose tables differ from those its runs' JSON give, saying how to
    regenerate it."""
    out = []
    for record in sorted(results.glob("*/*.json")):
        table = record.with_suffix(".md")
        if not table.exists():
            continue
        if tables(record.parent, record.stem, heading="##", partial=True) not in table.read_text(encoding="utf-8"):
            out.append(f"out of date: {table.relative_to(results.parent)} (bubblefree reproduce {record.stem} "
                       f"--report --out {table.parent.relative_to(results.parent)})")
    return out


def unbacked_intervals(root: Path = ROOT) -> list[str]:
    """One line per figure with an interval written by hand in README.md or docs/*.md (outside fenced code,
    generated parts and quoted cells): in the report pages (:data:`_REPORTS`) every such figure, elsewhere one that
    no table under ``root/results`` holds, whitespace aside."""
    tables_text = " ".join(" ".join(p.read_text(encoding="utf-8").split()) for p in (root / "results").glob("*/*.md"))
    out = []
    readme = root / "README.md"
    for path in [*([readme] if readme.exists() else []), *sorted((root / "docs").glob("*.md"))]:
        prose = _NOT_PROSE.sub("", path.read_text(encoding="utf-8"))
        report = str(path.relative_to(root)) in _REPORTS
        for match in _INTERVAL.finditer(prose):
            figure = " ".join(match.group(0).split())
            if report:
                out.append(f"typed by hand: {figure} ({path.relative_to(root)}; quote the findings table's cell: "
                           f"<!-- cell:ROW/COLUMN -->...<!-- /cell -->)")
            elif figure not in tables_text:
                out.append(f"not in any table under results/: {figure} ({path.relative_to(root)})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bubblefree.docs", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report parts that are out of date")
    args = parser.parse_args(argv)
    stale = [path for path, text in generate().items() if path.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"out of date: {path}", file=sys.stderr)
        results = stale_results() + unbacked_intervals()
        for line in results:
            print(line, file=sys.stderr)
        return 1 if stale or results else 0
    for path, text in generate().items():
        path.write_text(text, encoding="utf-8")
    print(f"bubblefree: rewrote {len(stale)} file(s) of docs/", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
