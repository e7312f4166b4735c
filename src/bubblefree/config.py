"""Typed run configuration, the bottom layer of the package: the sections of :mod:`bubblefree.sections` (one
dataclass per section, a docstring per field) put together in one :class:`Config`.

Every key is addressable from the command line as ``--set section.key=value`` and from a TOML file with
``[section]`` tables. Defaults follow the paper's recipe (arXiv 2606.30634): cosine decay to 10 % of peak
after 10 % warmup, clipping 1.0, weight decay 0.1.

This module imports only the errors, the sections and the schedule table (:mod:`bubblefree.schedules.table`,
which imports nothing), so every part can read a config, and it holds every rule a config must satisfy in one
:func:`validate`: a key's own rules are its field's metadata (``choices``, bounds, the optimizers the key applies
to), the rules that relate keys are written out in :func:`validate`, those of a schedule's layout are its row
of the schedule table. Every number key has a finite range (:data:`RANGES`, listed in docs/reliability.md).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from bubblefree.errors import UserError
from bubblefree.schedules.table import DISTRIBUTED_SCHEDULES, SCHEDULES, get_schedule
from bubblefree.sections import (
    CORRECTIONS,
    MAX_SEED,
    MAX_STEPS,
    MAX_VOCAB,
    MIN_BPE_VOCAB,
    MODEL_PRESETS,
    OPTIMIZERS,
    DataConfig,
    DelayConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
)

__all__ = [
    "CHOICES",
    "CORRECTIONS",
    "DISTRIBUTED_SCHEDULES",
    "FLOAT_MAX",
    "INT_MAX",
    "KEEPS_MOMENTUM",
    "MAX_SEED",
    "MAX_STEPS",
    "MAX_VOCAB",
    "MIN_BPE_VOCAB",
    "MODEL_PRESETS",
    "MOMENTUM_CORRECTIONS",
    "OPTIMIZERS",
    "RANGES",
    "RENAMED",
    "SCHEDULES",
    "Config",
    "DataConfig",
    "DelayConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "Range",
    "TrainConfig",
    "apply_overrides",
    "config_diff",
    "config_from_dict",
    "config_to_dict",
    "dump_toml",
    "field_docs",
    "parse_override",
    "ranges_markdown",
    "read_toml",
    "reference_markdown",
    "unused_keys",
    "validate",
]

MOMENTUM_CORRECTIONS = ("update-ema",)
"""The corrections that are the method's momentum (``Correction.owns_momentum``): they need ``optim.momentum = 0``."""
KEEPS_MOMENTUM = ("adan",)
"""The optimizers that keep a momentum of their own at ``optim.momentum = 0`` (``OptimizerSpec.momentum_free``
False), so that no correction of :data:`MOMENTUM_CORRECTIONS` can run around them."""
RENAMED = {"delay.nesterov_gamma": "delay.ema_beta"}
"""Keys renamed since runs were first recorded, old ``section.key`` -> new. The old name still reads wherever a
config comes from: a config file, ``--set``, a checkpoint, a run's JSON (:func:`config_from_dict` and
:func:`parse_override` say once per process that it was renamed; :func:`apply_overrides` maps it silently, for
code). Run ids hash the key under its old name (``bubblefree.experiments.runner.identity``), so no finished
result changes id."""


INT_MAX = 2**63 - 1
"""The cap of an integer key that has no smaller one: config.toml and checkpoints hold every key as a TOML
integer, which is 64-bit signed."""
FLOAT_MAX = 3.4028234663852886e38
"""The cap of a number key that has no smaller one: the largest float32. Every coefficient is applied to
float32 tensors (the weights, their updates), where a larger number is inf."""


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    delay: DelayConfig = field(default_factory=DelayConfig)
    log: LogConfig = field(default_factory=LogConfig)


def _sections(config: Config | None = None) -> dict[str, Any]:
    config = config or Config()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _fields() -> dict[str, dataclasses.Field]:
    """``{"section.key": field}`` of every key, in declaration order."""
    return {f"{name}.{f.name}": f for name, section in _sections().items() for f in dataclasses.fields(section)}


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def _field_type(section: Any, key: str) -> type:
    (f,) = [f for f in dataclasses.fields(section) if f.name == key]
    return _SCALARS[f.type if isinstance(f.type, str) else f.type.__name__]


CHOICES: dict[str, tuple[str, ...]] = {key: f.metadata["choices"] for key, f in _fields().items()
                                       if "choices" in f.metadata}
"""Allowed values of every key with a fixed vocabulary (from the fields' metadata)."""


@dataclass(frozen=True)
class Range:
    """The values a number key takes: finite, from ``lo`` (None: no lower bound) to ``hi``, each bound itself
    allowed unless ``lo_open``/``hi_open``; ``limit`` names what bounds it further (``_key``)."""

    lo: float | None
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    limit: str = ""

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        return above and (value < self.hi if self.hi_open else value <= self.hi)

    def __str__(self) -> str:
        """``in [1, 99999999]``, ``< 1``; a bound that is only the type's cap gives way to a ``limit``:
        ``>= 1 and at most what the machine's memory holds``."""
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {_number(self.hi)}"
        if self.limit and self.hi in (INT_MAX, FLOAT_MAX):
            return f"{'>' if self.lo_open else '>='} {_number(self.lo)} and at most {self.limit}"
        interval = f"{'(' if self.lo_open else '['}{_number(self.lo)}, {_number(self.hi)}{')' if self.hi_open else ']'}"
        return f"in {interval}" + (f" and at most {self.limit}" if self.limit else "")


def _number(x: float) -> str:
    return {INT_MAX: "2^63-1", FLOAT_MAX: "3.4e38"}.get(x, f"{x:g}" if isinstance(x, float) else str(x))


def _range(f: dataclasses.Field) -> Range:
    """A number field's :class:`Range` from its metadata: an integer's open bound becomes the closed one next to
    it (``gt=0``: from 1), a missing upper bound is the type's cap."""
    rules, kind = f.metadata, type(f.default)
    lo, lo_open = (rules["gt"], True) if "gt" in rules else (rules.get("ge"), False)
    hi, hi_open = (rules["lt"], True) if "lt" in rules else (rules.get("le"), False)
    if hi is None:
        hi = INT_MAX if kind is int else FLOAT_MAX
    if kind is int:  # integers are said with closed bounds: "in [1, 99999999]", not "(0, 99999999]"
        lo, lo_open = (lo + 1 if lo_open else lo), False
        hi, hi_open = (hi - 1 if hi_open else hi), False
    return Range(lo, hi, lo_open, hi_open, rules.get("limit", ""))


RANGES: dict[str, Range] = {key: _range(f) for key, f in _fields().items()
                            if type(f.default) in (int, float)}
"""The range of every number key (from the fields' metadata): :func:`validate` refuses a value outside it, and
docs/reliability.md lists them (:func:`ranges_markdown`)."""


def _resolve(config: Config, dotted: str) -> tuple[Any, str, type]:
    """Return (section object, key, expected type) for ``section.key``, or a UserError naming valid keys."""
    name, sep, key = dotted.partition(".")
    sections = _sections(config)
    if not sep or name not in sections:
        close = difflib.get_close_matches(name, sections, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"Invalid config key: {dotted!r}{hint}; keys are section.key with sections "
                        f"{', '.join(sections)}")
    section = sections[name]
    keys = [f.name for f in dataclasses.fields(section)]
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=1)
        hint = f" (did you mean {name}.{close[0]}?)" if close else ""
        raise UserError(f"Invalid config key: {dotted!r}{hint}; valid keys of [{name}]: {', '.join(keys)}")
    return section, key, _field_type(section, key)


def _typed(dotted: str, value: Any, expected: type) -> Any:
    """Check a value read from TOML (already typed); an int is accepted for a float field, a bool never for a
    number (``True`` is an ``int`` in Python, not in a config)."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) <= FLOAT_MAX else math.copysign(math.inf, value)  # refused as not finite
    if type(value) is not expected:
        raise UserError(f"Invalid value for {dotted}: {value!r} (expected {_expected(dotted, expected)})")
    return value


def _expected(dotted: str, expected: type) -> str:
    """What a key takes, for a value of the wrong type: ``int in [1, 99999999]``, ``bool``."""
    return f"{expected.__name__} {RANGES[dotted]}" if dotted in RANGES else expected.__name__


_NOTED: set[str] = set()
"""The renamed keys already noted in this process."""


def _current_name(dotted: str, *, note: bool) -> str:
    """``dotted``'s name now (:data:`RENAMED`); with ``note``, the first old name read says its new one (on
    stdout, like the training loop's notes: a refused run's stderr stays the one line of its error)."""
    new = RENAMED.get(dotted, dotted)
    if note and new != dotted and dotted not in _NOTED:
        _NOTED.add(dotted)
        print(f"bubblefree: note: {dotted} is now {new}", flush=True)
    return new


def parse_override(config: Config, text: str) -> tuple[str, Any]:
    """Parse one ``section.key=value`` into ``(dotted key, typed value)`` against ``config``'s field types.

    ``int`` accepts only integers, ``float`` any decimal or exponent number (so ``3`` and ``3e-4``), ``bool``
    ``true/false/1/0/yes/no``, ``str`` the text as is. Anything else is a UserError naming key, value and type.
    """
    dotted, sep, raw = text.partition("=")
    dotted, raw = dotted.strip(), raw.strip()
    if not sep or not dotted:
        raise UserError(f"Invalid override: {text!r} (expected section.key=value)")
    dotted = _current_name(dotted, note=True)
    _, _, expected = _resolve(config, dotted)
    try:
        if expected is bool:
            value: Any = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[raw.lower()]
        else:
            value = expected(raw)
    except (KeyError, ValueError):
        raise UserError(f"Invalid value for {dotted}: {raw!r} (expected {_expected(dotted, expected)})") from None
    return dotted, value


def apply_overrides(config: Config, values: dict[str, Any]) -> Config:
    """Return a copy of ``config`` with ``{"section.key": value}`` set (values type-checked as from TOML)."""
    sections = {name: dataclasses.replace(section) for name, section in _sections(config).items()}
    for dotted, value in values.items():
        dotted = _current_name(dotted, note=False)
        _, key, expected = _resolve(config, dotted)
        setattr(sections[dotted.partition(".")[0]], key, _typed(dotted, value, expected))
    return Config(**sections)


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}``: the form of config.toml and of checkpoints."""
    return dataclasses.asdict(config)


def config_from_dict(data: dict[str, Any], *, base: Config | None = None, origin: str = "config") -> Config:
    """Build a Config from ``{section: {key: value}}`` on top of ``base`` (defaults), type-checking every value."""
    flat: dict[str, Any] = {}
    for name, table in data.items():
        if not isinstance(table, dict):
            raise UserError(f"Invalid {origin}: top-level key {name!r} must be a [section] table "
                            f"(sections: {', '.join(_sections())})")
        for key, value in table.items():
            dotted = _current_name(f"{name}.{key}", note=True)
            if dotted in flat:  # only a renamed key can come twice: TOML refuses a repeated key
                old = next(o for o, n in RENAMED.items() if n == dotted)
                raise UserError(f"Invalid {origin}: it sets both {old} and {dotted}, the old and the new name of one "
                                f"key; keep {dotted}")
            flat[dotted] = value
    return apply_overrides(base or Config(), flat)


def config_diff(a: Config, b: Config) -> dict[str, tuple[Any, Any]]:
    """``{"section.key": (value in a, value in b)}`` for every key that differs."""
    da, db = config_to_dict(a), config_to_dict(b)
    return {f"{s}.{k}": (da[s][k], db[s][k]) for s in da for k in da[s] if da[s][k] != db[s][k]}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        # repr round-trips exactly; TOML spells infinities and NaN without a leading sign for +.
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                        ("inf" if value > 0 else "-inf"))
    assert isinstance(value, str), value
    # A TOML basic string: escape the quote, the backslash and the control characters, keep the rest as is.
    return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else "\\" + c if c in '"\\'
                         else c for c in value) + '"'


def dump_toml(config: Config) -> str:
    """The fully resolved config as TOML: one ``[section]`` table per section, one line per key."""
    lines = []
    for name, table in config_to_dict(config).items():
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
        lines.append("")
    return "\n".join(lines)


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file, turning a missing or malformed file into a one-line UserError."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"Invalid config file: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"Invalid config file: {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"Invalid config file: {path} is not valid TOML ({e})") from None


def unused_keys(config: Config) -> list[str]:
    """One line for each key set away from its default that the run's optimizer does not use.

    Not an error: the reproduction scales set ``optim.max_precond_dim`` once for every optimizer of a
    comparison, so that SOAP gets it; the training loop prints these lines once at the start of a run.
    """
    flat = {f"{s}.{k}": v for s, table in config_to_dict(config).items() for k, v in table.items()}
    return [f"{key} = {flat[key]!r} does nothing for optim.name = {config.optim.name!r} (it applies only to "
            f"{' and '.join(f.metadata['only_for'])})"
            for key, f in _fields().items()
            if "only_for" in f.metadata and flat[key] != f.default and config.optim.name not in f.metadata["only_for"]]


def validate(config: Config, *, replicas: int | None = None) -> Config:
    """Check every rule a config must satisfy; raise a UserError naming the first bad key. Returns ``config``.

    A key's own rules are its field's metadata (:func:`_key`); the rules that relate keys follow. The rules
    of the distributed runtime apply when ``pipeline.runtime`` is ``distributed`` or ``replicas`` is given:
    the number of data-parallel copies of the pipeline (processes / ``pipeline.stages``; 1 when not given).
    The launchers check with it before any process starts, and every rank again with its own count.
    """
    flat = {f"{s}.{k}": v for s, table in config_to_dict(config).items() for k, v in table.items()}
    for key, f in _fields().items():
        value, rules = flat[key], f.metadata
        if "choices" in rules and value not in rules["choices"]:
            close = difflib.get_close_matches(str(value), rules["choices"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"Invalid {key}: {value!r}{hint}; choose from {', '.join(rules['choices'])}")
        if key in RANGES and value not in RANGES[key]:
            finite = "finite and " if isinstance(value, float) and not math.isfinite(value) else ""
            note = f"; {rules['note']}" if "note" in rules else ""
            raise UserError(f"Invalid {key}: {value} (must be {finite}{RANGES[key]}{note})")

    if config.model.init_sha256 and not config.model.init_from:
        raise UserError("Invalid model.init_sha256: set without model.init_from (it pins that folder's weights)")
    train, pipe, correction = config.train, config.pipeline, config.delay.correction
    if correction == "taylor" and config.delay.taylor_lambda == 0:
        raise UserError("Invalid delay.taylor_lambda: 0.0 with delay.correction = taylor (lambda 0 is the plain "
                        "delay: set a lambda > 0, or delay.correction = none)")
    if correction in MOMENTUM_CORRECTIONS and config.optim.name in KEEPS_MOMENTUM:
        raise UserError(f"Invalid optim.name: {config.optim.name!r} with delay.correction = {correction} (the "
                        f"correction is the method's momentum and needs an optimizer without one, but "
                        f"{config.optim.name} keeps one at optim.momentum = 0 (docs/delay.md): choose another "
                        f"optimizer)")
    if correction in MOMENTUM_CORRECTIONS and config.optim.momentum != 0:
        momentum = config.optim.momentum
        which = " (the optimizer's default)" if momentum < 0 else ""
        raise UserError(f"Invalid optim.momentum: {momentum}{which} with delay.correction = {correction} (the "
                        f"correction is the optimizer's momentum, moved outside the delay: set optim.momentum = 0 "
                        f"so that the inner optimizer's own momentum does not compound with it)")
    if pipe.microbatches > train.batch_size:
        raise UserError(f"Invalid pipeline.microbatches: {pipe.microbatches} (must be in [1, train.batch_size = "
                        f"{train.batch_size}]: a microbatch holds at least one sequence)")
    if train.batch_size % pipe.microbatches:
        raise UserError(f"Invalid train.batch_size: {train.batch_size} (must be divisible by "
                        f"pipeline.microbatches = {pipe.microbatches})")
    if train.nonfinite == "skip" and pipe.runtime != "sim":
        raise UserError("Invalid train.nonfinite: 'skip' needs pipeline.runtime = 'sim' (the stages of an "
                        "asynchronous pipeline update before the step's loss is known); use 'stop'")
    if pipe.runtime == "distributed" or replicas is not None:
        P, m, R = pipe.stages, pipe.microbatches, replicas or 1
        schedule = get_schedule(pipe.schedule)  # its layout rules and their reasons are the schedule table's
        if schedule.runtime is None:
            why = f"; {schedule.no_runtime}" if schedule.no_runtime else ""
            raise UserError(f"Invalid pipeline.schedule: {pipe.schedule!r} (the distributed runtime runs "
                            f"{', '.join(DISTRIBUTED_SCHEDULES)}{why})")
        if m % R:
            raise UserError(f"Invalid pipeline.microbatches: {m} (must divide train.batch_size = "
                            f"{train.batch_size} and be a multiple of the {R} replicas)")
        if (needs := schedule.runtime_needs) is not None and not needs.met(m // R, P):
            raise UserError(f"Invalid pipeline.microbatches: {m} ({needs.reason(P, R)})")
    return config


def field_docs() -> dict[str, list[tuple[str, str, Any, str]]]:
    """``{section: [(key, type, default, docstring)]}`` read from the attribute docstrings of the sections
    (:mod:`bubblefree.sections`).

    Used to generate the config reference in docs/training.md, so the reference cannot drift from the code.
    """
    tree = ast.parse(inspect.getsource(inspect.getmodule(ModelConfig)))  # bubblefree.sections
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for stmt, nxt in zip(body, body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                    docs.setdefault(node.name, {})[stmt.target.id] = " ".join(str(nxt.value.value).split())
    out: dict[str, list[tuple[str, str, Any, str]]] = {}
    for name, section in _sections().items():
        cls = type(section).__name__
        out[name] = [(f.name, _field_type(section, f.name).__name__, getattr(section, f.name),
                      docs.get(cls, {}).get(f.name, "")) for f in dataclasses.fields(section)]
    return out


def ranges_markdown() -> str:
    """The table of number keys in docs/reliability.md: each key's :data:`RANGES` entry and default."""
    fields = _fields()
    out = ["| key | type | must be | default |", "|---|---|---|---|"]
    for key, r in RANGES.items():
        f = fields[key]
        note = f" ({f.metadata['note']})" if "note" in f.metadata else ""
        out.append(f"| `{key}` | {type(f.default).__name__} | {r}{note} | `{_toml_value(f.default)}` |")
    return "\n".join(out) + "\n"


def reference_markdown() -> str:
    """The config reference of docs/training.md: one table per section, generated from :func:`field_docs`."""
    out = []
    for section, rows in field_docs().items():
        out += [f"**[{section}]**", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{section}.{key}` | {kind} | `{_toml_value(default)}` | {doc.replace('|', '/')} |"
                for key, kind, default, doc in rows]
        out.append("")
    return "\n".join(out)
