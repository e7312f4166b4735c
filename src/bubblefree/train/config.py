"""Typed run configuration: one dataclass per section, a docstring per field.

Every key is addressable from the command line as ``--set section.key=value`` and from a TOML file with
``[section]`` tables (DESIGN.md section 6 names the keys other parts rely on). Defaults follow the paper's
recipe (arXiv 2606.30634): cosine decay to 10 % of peak after 10 % warmup, clipping 1.0, weight decay 0.1.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from bubblefree.errors import UserError

__all__ = [
    "CHOICES",
    "Config",
    "DataConfig",
    "DelayConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "TrainConfig",
    "apply_overrides",
    "config_diff",
    "config_from_dict",
    "config_to_dict",
    "dump_toml",
    "field_docs",
    "load_config",
    "parse_override",
    "read_toml",
    "reference_markdown",
    "validate",
]


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = "llama-5m"
    """Model preset name (see ``bubblefree.models.PRESETS``): llama-1m, llama-5m, llama-20m, moe-20m,
    smollm2-135m, smollm2-360m, ... (llama-5m with a 4096 vocabulary is the 3.3M model of DESIGN.md section 7)."""

    vocab_size: int = 0
    """Vocabulary size; 0 takes the tokenizer's."""


@dataclass(kw_only=True)
class DataConfig:
    source: str = "embedded"
    """``embedded`` (the vendored public-domain corpus), a path to a text file or folder, a folder of
    nanoGPT-style ``.bin`` shards, or ``hf:NAME`` for a Hugging Face ``datasets`` dataset (optional extra)."""

    tokenizer: str = "bpe"
    """``bpe`` (byte-level BPE trained on first use and cached) or ``byte`` (256 symbols, needs nothing)."""

    vocab_size: int = 4096
    """BPE vocabulary size (4096 as in the CPU prototype of DESIGN.md section 7)."""

    cache_dir: str = ""
    """Where tokenizers and token streams are cached; empty means ``$BUBBLEFREE_CACHE`` or ``~/.cache/bubblefree``."""


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "muon"
    """One of adamw, muon, soap, adan, lion, mars."""

    lr: float = 0.0
    """Peak learning rate; 0 takes the optimizer's documented default for LLM pretraining."""

    momentum: float = -1.0
    """The momentum knob of DESIGN.md section 1 (AdamW beta1, Muon mu, SOAP beta1, Adan beta1, Lion beta2,
    MARS beta1); negative takes the optimizer's default."""

    weight_decay: float = 0.1
    """Decoupled weight decay (the paper uses 0.1)."""

    adamw_lr: float = 0.0
    """Learning rate of the AdamW part of Muon and MARS (embeddings, head, norms); 0 takes the default."""

    max_precond_dim: int = 0
    """SOAP only: dimensions longer than this keep the identity basis (Adam along them); 0 takes SOAP's
    10000. The paper's 49152 vocabulary is never preconditioned; a small vocabulary needs a smaller value for
    the same regime."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps."""

    batch_size: int = 16
    """Sequences per optimizer step (split into ``pipeline.microbatches`` microbatches)."""

    seq_len: int = 128
    """Tokens per sequence."""

    seed: int = 0
    """Seeds model init and the data order; batches are a function of (seed, step, microbatch)."""

    warmup_frac: float = 0.1
    """Linear warmup over this fraction of the steps."""

    min_lr_frac: float = 0.1
    """Cosine decay ends at this fraction of the peak learning rate."""

    grad_clip: float = 1.0
    """Gradient-norm clip (0 disables). With P pipeline stages each stage clips its own gradients to
    ``grad_clip / sqrt(P)`` so no pipeline-wide barrier is needed; P = 1 is ordinary global clipping."""

    eval_every: int = 50
    """Evaluate on the validation split every N steps (and at the end); 0 only at the end."""

    eval_batches: int = 8
    """Validation batches per evaluation (fixed, deterministic windows)."""

    log_every: int = 10
    """Write one metrics line every N steps."""

    ckpt_every: int = 50
    """Checkpoint every N steps (0: only at the end). The demo's 300 steps take 2 minutes on 2 idle cores and
    can take an hour on a busy machine: a crash then loses at most 50 steps."""

    ckpt_keep: int = 2
    """Keep the newest N checkpoints of the run; older ones are deleted after a new one is safely written."""

    device: str = "auto"
    """``auto`` (cuda if available), ``cpu`` or ``cuda``."""

    dtype: str = "auto"
    """Compute dtype: ``auto`` (bf16 autocast on GPU, fp32 on CPU), ``float32`` or ``bfloat16``."""

    nonfinite: str = "stop"
    """A step whose loss or gradient norm is not finite: ``stop`` (exit code 3, naming the step and the last
    good checkpoint) or ``skip`` (no update for that batch, counted as ``skipped`` in metrics.jsonl; the
    simulation only). See docs/reliability.md."""

    threads: int = 0
    """CPU threads for torch's kernels; 0 keeps torch's default (one per core). Importing bubblefree sets
    ``OMP_WAIT_POLICY=PASSIVE`` (unless set), so idle threads sleep instead of spinning for busy cores: on a
    loaded machine that made the demo 3-7x faster (docs/training.md, "Threads")."""

    compile: bool = False
    """Compile each dense transformer block with ``torch.compile`` (inductor; eager when false; MoE blocks
    stay eager, their routing changes shapes every batch). Fuses the elementwise work around the matmuls
    (RoPE, RMSNorm, SwiGLU); losses agree with eager to float32 rounding, not bit for bit. The first steps
    pay the compilation. See docs/throughput.md."""


@dataclass(kw_only=True)
class PipelineConfig:
    schedule: str = "2bw"
    """``sync``, ``gpipe``, ``1f1b`` (synchronous), ``2bw`` (delay 1 on every stage), ``pipedream``
    (delay P-1-s at stage s), ``wpipe``."""

    stages: int = 2
    """Pipeline stages P (the simulation uses them for per-stage delays and clipping)."""

    microbatches: int = 2
    """Microbatches per optimizer step (gradient accumulation in the simulation)."""

    runtime: str = "sim"
    """``sim`` (one process, exact delayed-gradient simulation) or ``distributed`` (one process per stage)."""


@dataclass(kw_only=True)
class DelayConfig:
    correction: str = "ef"
    """``none``, ``ef`` (Error Feedback), ``taylor`` (DC-ASGD), ``nesterov`` (Ajanthan et al. 2025), ``predict``
    (weight prediction: the stale gradient is taken at the weights extrapolated along their last change). The
    rules are in docs/delay.md."""

    ef_beta: float = 1.0
    """Error Feedback coefficient beta in [0, 1]: x_{t+1} = x_t - u_t - beta (u_t - u_{t-d}); 1 is the paper's rule."""

    taylor_lambda: float = 0.0
    """Taylor (DC-ASGD) coefficient lambda: the optimizer sees g + lambda g*g*(x_t - x_{t-d}). Must be > 0 with
    ``correction = "taylor"`` (0 would be the plain delay, which is ``correction = "none"``)."""

    taylor_adaptive: bool = False
    """Taylor only: DC-ASGD-a, lambda divided elementwise by sqrt(v + 1e-7), v the running mean square of the
    gradient (decay 0.95, the DC-ASGD paper's constants): the term then grows like |g|, not g*g."""

    nesterov_gamma: float = 0.99
    """Nesterov only: the momentum gamma in [0, 1) of Ajanthan et al. 2025 (their 0.99; a time constant of
    1 / (1 - gamma) steps)."""

    predict_scale: float = 1.0
    """Weight prediction only: alpha > 0 in x^ = x_j + alpha d (x_j - x_{j-1}); 1 extrapolates the last change of
    the weights linearly over the d steps of delay."""

    sync_start_steps: int = 0
    """Train the first K steps synchronously (delay 0)."""

    sync_cooldown_steps: int = 0
    """Train the last K steps synchronously (delay 0)."""


@dataclass(kw_only=True)
class LogConfig:
    tensorboard: bool = False
    """Also write TensorBoard event files (needs the ``tensorboard`` extra)."""

    progress: bool = True
    """Show a progress bar with loss and throughput."""


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    delay: DelayConfig = field(default_factory=DelayConfig)
    log: LogConfig = field(default_factory=LogConfig)


# Allowed values of the string keys with a fixed vocabulary of this module (DESIGN.md section 6). Optimizer,
# schedule, correction and model names are checked against the registries that own them (``_registries``), so
# adding one there needs no edit here.
CHOICES: dict[str, tuple[str, ...]] = {
    "data.tokenizer": ("bpe", "byte"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.dtype": ("auto", "float32", "bfloat16"),
    "train.nonfinite": ("stop", "skip"),
    "pipeline.runtime": ("sim", "distributed"),
}


def _registries() -> dict[str, tuple[str, ...]]:
    from bubblefree.delay import CORRECTIONS
    from bubblefree.models import PRESETS
    from bubblefree.optim import OPTIMIZERS
    from bubblefree.schedules.delays import SCHEDULES

    return {"model.preset": tuple(PRESETS), "optim.name": tuple(OPTIMIZERS), "pipeline.schedule": SCHEDULES,
            "delay.correction": tuple(CORRECTIONS)}


# Keys that must be > 0 and keys that must be >= 0 (numbers); fractions must lie in [0, 1].
_POSITIVE = ("data.vocab_size", "train.steps", "train.batch_size", "train.seq_len", "train.eval_batches",
             "train.log_every", "train.ckpt_keep", "pipeline.stages", "pipeline.microbatches")
_NONNEGATIVE = ("model.vocab_size", "optim.lr", "optim.weight_decay", "optim.adamw_lr", "optim.max_precond_dim",
                "train.seed",
                "train.grad_clip", "train.threads", "train.eval_every", "train.ckpt_every", "delay.ef_beta",
                "delay.taylor_lambda", "delay.sync_start_steps", "delay.sync_cooldown_steps")
_FRACTIONS = ("train.warmup_frac", "train.min_lr_frac")
_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def _sections(config: Config | None = None) -> dict[str, Any]:
    config = config or Config()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _field_type(section: Any, key: str) -> type:
    (f,) = [f for f in dataclasses.fields(section) if f.name == key]
    return _SCALARS[f.type if isinstance(f.type, str) else f.type.__name__]


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
        value = float(value)
    if type(value) is not expected:
        raise UserError(f"Invalid value for {dotted}: {value!r} (expected {expected.__name__})")
    return value


def parse_override(config: Config, text: str) -> tuple[str, Any]:
    """Parse one ``section.key=value`` into ``(dotted key, typed value)`` against ``config``'s field types.

    ``int`` accepts only integers, ``float`` any decimal or exponent number (so ``3`` and ``3e-4``), ``bool``
    ``true/false/1/0/yes/no``, ``str`` the text as is. Anything else is a UserError naming key, value and type.
    """
    dotted, sep, raw = text.partition("=")
    dotted, raw = dotted.strip(), raw.strip()
    if not sep or not dotted:
        raise UserError(f"Invalid override: {text!r} (expected section.key=value)")
    _, _, expected = _resolve(config, dotted)
    try:
        if expected is bool:
            value: Any = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[raw.lower()]
        else:
            value = expected(raw)
    except (KeyError, ValueError):
        raise UserError(f"Invalid value for {dotted}: {raw!r} (expected {expected.__name__})") from None
    return dotted, value


def apply_overrides(config: Config, values: dict[str, Any]) -> Config:
    """Return a copy of ``config`` with ``{"section.key": value}`` set (values type-checked as from TOML)."""
    sections = {name: dataclasses.replace(section) for name, section in _sections(config).items()}
    for dotted, value in values.items():
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
        flat.update({f"{name}.{key}": value for key, value in table.items()})
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


def validate(config: Config) -> Config:
    """Check sizes, ranges and choices; raise a UserError naming the first bad key. Returns ``config``."""
    flat = {f"{s}.{k}": v for s, table in config_to_dict(config).items() for k, v in table.items()}
    for key, value in flat.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"Invalid {key}: {value} (must be finite)")
    for key, allowed in {**CHOICES, **_registries()}.items():
        if flat[key] not in allowed:
            close = difflib.get_close_matches(str(flat[key]), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"Invalid {key}: {flat[key]!r}{hint}; choose from {', '.join(allowed)}")
    for key in _POSITIVE:
        if not flat[key] > 0:
            raise UserError(f"Invalid {key}: {flat[key]} (must be > 0)")
    for key in _NONNEGATIVE:
        if not flat[key] >= 0:  # also rejects NaN
            raise UserError(f"Invalid {key}: {flat[key]} (must be >= 0)")
    for key in _FRACTIONS:
        if not 0.0 <= flat[key] <= 1.0:
            raise UserError(f"Invalid {key}: {flat[key]} (must be in [0, 1])")
    if not flat["delay.ef_beta"] <= 1.0:
        raise UserError(f"Invalid delay.ef_beta: {flat['delay.ef_beta']} (must be in [0, 1])")
    if not 0.0 <= flat["delay.nesterov_gamma"] < 1.0:
        raise UserError(f"Invalid delay.nesterov_gamma: {flat['delay.nesterov_gamma']} (must be in [0, 1))")
    if not flat["delay.predict_scale"] > 0:
        raise UserError(f"Invalid delay.predict_scale: {flat['delay.predict_scale']} (must be > 0)")
    if flat["delay.correction"] == "taylor" and flat["delay.taylor_lambda"] == 0:
        raise UserError("Invalid delay.taylor_lambda: 0.0 with delay.correction = taylor (lambda 0 is the plain "
                        "delay: set a lambda > 0, or delay.correction = none)")
    if not flat["optim.momentum"] < 1.0:
        raise UserError(f"Invalid optim.momentum: {flat['optim.momentum']} (must be < 1; negative = default)")
    if config.train.batch_size % config.pipeline.microbatches:
        raise UserError(f"Invalid train.batch_size: {config.train.batch_size} (must be divisible by "
                        f"pipeline.microbatches = {config.pipeline.microbatches})")
    return config


def load_config(preset: str | None = None, toml_path: str | Path | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Resolve a run's configuration with precedence preset < TOML file < ``--set`` overrides, then validate.

    ``preset=None`` is the default run (``demo``, the paper's recipe). ``overrides`` are ``section.key=value``.
    """
    from bubblefree.train.presets import get_preset

    config = get_preset(preset or "demo")
    if toml_path is not None:
        config = config_from_dict(read_toml(toml_path), base=config, origin=f"config file {toml_path}")
    parsed: dict[str, Any] = {}
    for text in overrides:
        key, value = parse_override(config, text)
        parsed[key] = value
    return validate(apply_overrides(config, parsed))


def field_docs() -> dict[str, list[tuple[str, str, Any, str]]]:
    """``{section: [(key, type, default, docstring)]}`` read from the attribute docstrings of this module.

    Used to generate the config reference in docs/training.md, so the reference cannot drift from the code.
    """
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(inspect.getmodule(Config)))
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


def reference_markdown() -> str:
    """The config reference of docs/training.md: one table per section, generated from :func:`field_docs`."""
    out = []
    for section, rows in field_docs().items():
        out += [f"**[{section}]**", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{section}.{key}` | {kind} | `{_toml_value(default)}` | {doc.replace('|', '/')} |"
                for key, kind, default, doc in rows]
        out.append("")
    return "\n".join(out)
