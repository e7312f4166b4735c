"""Typed run configuration, the bottom layer of the package: one dataclass per section, a docstring per field.

Every key is addressable from the command line as ``--set section.key=value`` and from a TOML file with
``[section]`` tables. Defaults follow the paper's recipe (arXiv 2606.30634): cosine decay to 10 % of peak
after 10 % warmup, clipping 1.0, weight decay 0.1.

This module imports nothing from the rest of the package, so every part can read a config, and it holds
every rule a config must satisfy in one :func:`validate`: a key's own rules are its field's metadata
(``choices``, bounds, the optimizers the key applies to), the rules that relate keys are written out in
:func:`validate`. Every number key has a finite range (:data:`RANGES`, listed in docs/reliability.md). The
names owned by registries higher up (optimizers, model presets, schedules, corrections) are listed here as
choices; a test checks each list against the registry that owns it.
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

__all__ = [
    "CHOICES",
    "DISTRIBUTED_SCHEDULES",
    "FLOAT_MAX",
    "INT_MAX",
    "MAX_SEED",
    "MAX_STEPS",
    "MAX_VOCAB",
    "MIN_BPE_VOCAB",
    "RANGES",
    "RENAMED",
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

MODEL_PRESETS = ("llama-1m", "llama-5m", "llama-20m", "moe-20m", "smollm2-135m", "smollm2-360m", "llama-1b",
                 "moe-2b", "moe-10b", "deep-1m", "deep-3m", "deep-30m", "moe-1m", "moe-6m", "byte-0.5m",
                 "byte-deep-0.5m", "byte-moe-0.5m")
"""The names of ``bubblefree.models.PRESETS``."""
OPTIMIZERS = ("adamw", "muon", "lion", "adan", "mars", "soap", "nadamw")
"""The names of ``bubblefree.optim.OPTIMIZERS``."""
SCHEDULES = ("sync", "gpipe", "1f1b", "2bw", "pipedream", "wpipe")
"""``bubblefree.schedules.SCHEDULES``."""
DISTRIBUTED_SCHEDULES = ("sync", "gpipe", "1f1b", "2bw", "pipedream")
"""The schedules the distributed runtime runs (``wpipe`` puts two model partitions on each device)."""
CORRECTIONS = ("none", "ef", "taylor", "nesterov", "predict", "update-ema")
"""The names of ``bubblefree.delay.CORRECTIONS``."""
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
MIN_BPE_VOCAB = 257
"""``bubblefree.data.tokenizer.MIN_BPE_VOCAB``: a byte-level BPE holds the 256 bytes and at least one merge."""
MAX_VOCAB = 2**32
"""The most token ids a vocabulary may have: token streams are stored as uint32 (``data.cache.stream_dtype``)."""
MAX_STEPS = 10**8 - 1
"""The most optimizer steps a run may take: checkpoints are named by their step in 8 digits
(``step_NNNNNNNN.pt``), which a resume reads back."""
MAX_SEED = 2**32 - 1
"""The largest seed: the training loop seeds numpy's global generator, which takes 32 bits."""


def _key(default: Any, *, choices: tuple[str, ...] = (), gt: float | None = None, ge: float | None = None,
         lt: float | None = None, le: float | None = None, limit: str = "", only_for: tuple[str, ...] = (),
         note: str = "") -> Any:
    """A config field with its own rules as metadata: the allowed ``choices``; bounds ``gt``, ``ge``, ``lt``,
    ``le`` (``note`` is added to the message of a value outside them; a number without an upper bound is capped
    at :data:`INT_MAX` or :data:`FLOAT_MAX`, :data:`RANGES`); ``limit``: what bounds the key further, before anything is
    written: another key (:func:`validate`), or the model, the machine's memory or its cores, which a run checks
    at its start (``bubblefree.train.loop.check_lengths``); ``only_for``: the ``optim.name`` values the key applies to
    (:func:`unused_keys` names it when set for another optimizer)."""
    rules = {k: v for k, v in (("choices", choices), ("gt", gt), ("ge", ge), ("lt", lt), ("le", le),
                                ("limit", limit), ("only_for", only_for), ("note", note)) if v not in ((), None, "")}
    return field(default=default, metadata=rules)


_MEMORY = "what the machine's memory holds"
"""The ``limit`` of the keys that size a run's memory (``bubblefree.train.memory.check_memory``)."""


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = _key("llama-5m", choices=MODEL_PRESETS)
    """Model preset name (see ``bubblefree.models.PRESETS``): llama-1m, llama-5m, llama-20m, moe-20m,
    smollm2-135m, smollm2-360m, ... (llama-5m with a 4096 vocabulary has 3.3M parameters)."""

    vocab_size: int = _key(0, ge=0, le=MAX_VOCAB, limit=_MEMORY, note="token ids are stored as uint32")
    """Vocabulary size; 0 takes the tokenizer's."""

    init_from: str = ""
    """A local Hugging Face LLaMA folder (config.json, safetensors weights, tokenizer.json) to start from:
    its config.json gives the shapes (``preset`` is not used, ``vocab_size`` must be 0 or its own), its weights
    replace the random init and its tokenizer encodes text sources (``data.tokenizer`` and ``data.vocab_size``
    are not used). Empty: the preset, initialised from ``train.seed``. See docs/huggingface.md."""

    init_sha256: str = ""
    """The fingerprint of ``init_from``: sha256 of its shapes and weight files (docs/huggingface.md). Empty: the
    run records it at its start; a run or resume whose folder hashes otherwise is refused."""


@dataclass(kw_only=True)
class DataConfig:
    source: str = "embedded"
    """``embedded`` (the vendored public-domain corpus), a path to a text file or folder, a folder of
    nanoGPT-style ``.bin`` shards, or ``hf:NAME`` for a Hugging Face ``datasets`` dataset (optional extra)."""

    tokenizer: str = _key("bpe", choices=("bpe", "byte"))
    """``bpe`` (byte-level BPE trained on first use and cached) or ``byte`` (256 symbols, needs nothing)."""

    vocab_size: int = _key(4096, ge=MIN_BPE_VOCAB, le=MAX_VOCAB,
                           note="a BPE holds the 256 bytes and a merge; token ids are stored as uint32")
    """BPE vocabulary size (the most tokens; fewer when the text runs out of merges)."""

    cache_dir: str = ""
    """Where tokenizers and token streams are cached; empty means ``$BUBBLEFREE_CACHE`` or ``~/.cache/bubblefree``."""


@dataclass(kw_only=True)
class OptimConfig:
    name: str = _key("muon", choices=OPTIMIZERS)
    """One of adamw, muon, soap, adan, lion, mars, nadamw."""

    lr: float = _key(0.0, ge=0)
    """Peak learning rate; 0 takes the optimizer's documented default for LLM pretraining."""

    momentum: float = _key(-1.0, lt=1, note="negative = default")
    """The one momentum knob of every optimizer (AdamW beta1, Muon mu, SOAP beta1, Adan beta1, Lion beta2,
    MARS beta1, NAdamW beta1; docs/optimizers.md); negative takes the optimizer's default. Must be 0 with
    ``delay.correction = "update-ema"``, which is the momentum itself, moved outside the delay."""

    weight_decay: float = _key(0.1, ge=0)
    """Decoupled weight decay (the paper uses 0.1)."""

    adamw_lr: float = _key(0.0, ge=0, only_for=("muon", "mars"))
    """Learning rate of the AdamW part of Muon and MARS (embeddings, head, norms); 0 takes the default."""

    momentum_decay: float = _key(0.004, ge=0, only_for=("nadamw",))
    """NAdamW only: psi of the momentum schedule mu_t = beta1 (1 - 0.5 * 0.96^(t psi)); torch's 0.004, which
    Ajanthan et al. keep (mu_t then reaches 0.75 beta1 only after about 4245 steps)."""

    max_precond_dim: int = _key(0, ge=0, only_for=("soap",))
    """SOAP only: dimensions longer than this keep the identity basis (Adam along them); 0 takes SOAP's
    default (docs/optimizers.md). The paper's 49152 vocabulary is never preconditioned; a small vocabulary needs a
    smaller value for the same regime."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = _key(300, gt=0, le=MAX_STEPS, note="a checkpoint's name holds its step in 8 digits")
    """Optimizer steps."""

    batch_size: int = _key(16, gt=0, limit=_MEMORY)
    """Sequences per optimizer step (split into ``pipeline.microbatches`` microbatches)."""

    seq_len: int = _key(128, gt=0, limit="the model's longest sequence")
    """Tokens per sequence."""

    seed: int = _key(0, ge=0, le=MAX_SEED, note="numpy's global seed takes 32 bits")
    """Seeds model init and the data order; batches are a function of (seed, step, microbatch)."""

    warmup_frac: float = _key(0.1, ge=0, le=1)
    """Linear warmup over this fraction of the steps."""

    min_lr_frac: float = _key(0.1, ge=0, le=1)
    """Cosine decay ends at this fraction of the peak learning rate."""

    grad_clip: float = _key(1.0, ge=0)
    """Gradient-norm clip (0 disables). With P pipeline stages each stage clips its own gradients to
    ``grad_clip / sqrt(P)`` so no pipeline-wide barrier is needed; P = 1 is ordinary global clipping."""

    eval_every: int = _key(50, ge=0)
    """Evaluate on the validation split every N steps (and at the end); 0 only at the end."""

    eval_batches: int = _key(8, gt=0, limit=_MEMORY)
    """Validation batches per evaluation (fixed, deterministic windows: ``eval_batches x batch_size`` windows
    evenly spaced over the validation split, so the same product evaluates the same windows at any batch)."""

    test_split: bool = _key(False)
    """Set every second evaluation window aside as a test set: ``val_loss`` is then the mean over the even
    windows (the ones a sweep chooses on) and ``test_loss`` over the odd ones (the ones a study reports),
    disjoint from each other and from the training split."""

    log_every: int = _key(10, gt=0)
    """Write one metrics line every N steps."""

    ckpt_every: int = _key(50, ge=0)
    """Checkpoint every N steps (0: only at the end). The demo's 300 steps take 2 minutes on 2 idle cores and
    can take an hour on a busy machine: a crash then loses at most 50 steps."""

    ckpt_keep: int = _key(2, gt=0)
    """Keep the newest N checkpoints of the run; older ones are deleted after a new one is safely written."""

    device: str = _key("auto", choices=("auto", "cpu", "cuda"))
    """``auto`` (cuda if available), ``cpu`` or ``cuda``."""

    dtype: str = _key("auto", choices=("auto", "float32", "bfloat16"))
    """Compute dtype: ``auto`` (bf16 autocast on GPU, fp32 on CPU), ``float32`` or ``bfloat16``."""

    nonfinite: str = _key("stop", choices=("stop", "skip"))
    """A step whose loss or gradient norm is not finite: ``stop`` (exit code 3, naming the step and the last
    good checkpoint) or ``skip`` (no update for that batch, counted as ``skipped`` in metrics.jsonl; the
    simulation only). See docs/reliability.md."""

    threads: int = _key(0, ge=0, limit="the cores this process may use")
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
    schedule: str = _key("2bw", choices=SCHEDULES)
    """``sync``, ``gpipe``, ``1f1b`` (synchronous), ``2bw`` (delay 1 on every stage), ``pipedream``
    (delay P-1-s at stage s), ``wpipe``."""

    stages: int = _key(2, gt=0, limit="the model's layers (wpipe: half of them)")
    """Pipeline stages P (the simulation uses them for per-stage delays and clipping)."""

    microbatches: int = _key(2, gt=0, limit="train.batch_size")
    """Microbatches per optimizer step (gradient accumulation in the simulation)."""

    runtime: str = _key("sim", choices=("sim", "distributed"))
    """``sim`` (one process, exact delayed-gradient simulation) or ``distributed`` (one process per stage)."""


@dataclass(kw_only=True)
class DelayConfig:
    correction: str = _key("ef", choices=CORRECTIONS)
    """``none``, ``ef`` (Error Feedback), ``taylor`` (DC-ASGD), ``predict`` (weight prediction: the stale gradient
    is taken at the weights extrapolated along their last change), ``update-ema`` (an outer, bias-corrected EMA
    of the optimizer's updates; it is the method's momentum, so it needs ``optim.momentum = 0``: the inner
    optimizer's own momentum would compound with it), ``nesterov`` (the same EMA without bias correction, b_0 =
    0, around the optimizer at any momentum: the name it was first run under, kept so those runs keep their
    ids). Ajanthan et al.'s method is no correction: ``optim.name = "nadamw"`` with ``correction = "none"``. The
    rules are in docs/delay.md."""

    ef_beta: float = _key(1.0, ge=0, le=1)
    """Error Feedback coefficient beta in [0, 1]: x_{t+1} = x_t - u_t - beta (u_t - u_{t-d}); 1 is the paper's rule."""

    taylor_lambda: float = _key(0.0, ge=0)
    """Taylor (DC-ASGD) coefficient lambda: the optimizer sees g + lambda g*g*(x_t - x_{t-d}). Must be > 0 with
    ``correction = "taylor"`` (0 would be the plain delay, which is ``correction = "none"``)."""

    taylor_adaptive: bool = False
    """Taylor only: DC-ASGD-a, lambda divided elementwise by sqrt(v + 1e-7), v the running mean square of the
    gradient (decay 0.95, the DC-ASGD paper's constants): the term then grows like |g|, not g*g."""

    ema_beta: float = _key(0.99, ge=0, lt=1)
    """``update-ema`` and ``nesterov`` only: the update EMA's coefficient in [0, 1), ``gamma`` in the rules of
    docs/delay.md (a time constant of 1 / (1 - gamma) steps). With ``update-ema`` it is the run's only momentum
    (``optim.momentum = 0``). Formerly ``delay.nesterov_gamma``, a name still read (with a note)."""

    predict_scale: float = _key(1.0, gt=0)
    """Weight prediction only: alpha > 0 in x^ = x_j + alpha d (x_j - x_{j-1}); 1 extrapolates the last change of
    the weights linearly over the d steps of delay."""

    sync_start_steps: int = _key(0, ge=0)
    """Train the first K steps synchronously (delay 0)."""

    sync_cooldown_steps: int = _key(0, ge=0)
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
        if pipe.schedule not in DISTRIBUTED_SCHEDULES:
            why = ("; it has no WPipe loop: two partitions per process updating alternately; run it with "
                   "pipeline.runtime = sim" if pipe.schedule == "wpipe" else "")
            raise UserError(f"Invalid pipeline.schedule: {pipe.schedule!r} (the distributed runtime runs "
                            f"{', '.join(DISTRIBUTED_SCHEDULES)}{why})")
        if m % R:
            raise UserError(f"Invalid pipeline.microbatches: {m} (must divide train.batch_size = "
                            f"{train.batch_size} and be a multiple of the {R} replicas)")
        if pipe.schedule == "2bw" and m // R < P:
            raise UserError(f"Invalid pipeline.microbatches: {m} (2bw keeps two weight versions, which needs at "
                            f"least P = {P} microbatches per step and replica; there are {R} replicas)")
        if pipe.schedule == "1f1b" and m // R < P:
            raise UserError(f"Invalid pipeline.microbatches: {m} (1f1b needs at least P = {P} microbatches per "
                            f"step and replica, and there are {R} replicas; gpipe runs fewer)")
    return config


def field_docs() -> dict[str, list[tuple[str, str, Any, str]]]:
    """``{section: [(key, type, default, docstring)]}`` read from the attribute docstrings of this module.

    Used to generate the config reference in docs/training.md, so the reference cannot drift from the code.
    """
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
