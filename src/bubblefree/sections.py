"""The keys of a run's configuration: one dataclass per section, a docstring per field, and a key's own rules as
its field's metadata (:func:`_key`). :mod:`bubblefree.config` puts the sections together in its ``Config`` and
does everything else with them (TOML and ``--set``, ranges, ``validate``, the generated reference, which is read
from the docstrings here).

The names owned by registries higher up (optimizers, model presets, corrections) are listed here as choices; a
test checks each list against the registry that owns it. The schedules' names are the schedule table's, below
this module (:mod:`bubblefree.schedules.table`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bubblefree.schedules.table import SCHEDULES

__all__ = ["CORRECTIONS", "MAX_SEED", "MAX_STEPS", "MAX_VOCAB", "MIN_BPE_VOCAB", "MODEL_PRESETS", "OPTIMIZERS",
           "DataConfig", "DelayConfig", "LogConfig", "ModelConfig", "OptimConfig", "PipelineConfig", "TrainConfig"]

MODEL_PRESETS = ("llama-1m", "llama-5m", "llama-20m", "moe-20m", "smollm2-135m", "smollm2-360m", "llama-1b",
                 "moe-2b", "moe-10b", "deep-1m", "deep-3m", "deep-30m", "moe-1m", "moe-6m", "byte-0.5m",
                 "byte-deep-0.5m", "byte-moe-0.5m")
"""The names of ``bubblefree.models.PRESETS``."""
OPTIMIZERS = ("adamw", "muon", "lion", "adan", "mars", "soap", "nadamw")
"""The names of ``bubblefree.optim.OPTIMIZERS``."""
CORRECTIONS = ("none", "ef", "taylor", "nesterov", "predict", "update-ema")
"""The names of ``bubblefree.delay.CORRECTIONS``."""
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
    at ``config.INT_MAX`` or ``config.FLOAT_MAX``, ``config.RANGES``); ``limit``: what bounds the key further,
    before anything is written: another key (``config.validate``), or the model, the machine's memory or its
    cores, which a run checks at its start (``bubblefree.train.loop.check_lengths``); ``only_for``: the
    ``optim.name`` values the key applies to (``config.unused_keys`` names it when set for another optimizer)."""
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
