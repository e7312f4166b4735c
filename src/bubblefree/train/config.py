"""Typed run configuration: one dataclass per section, a docstring per field.

Every key is addressable from the command line as ``--set section.key=value`` and from a TOML file with
``[section]`` tables (DESIGN.md section 6 names the keys other parts rely on). Defaults follow the paper's
recipe (arXiv 2606.30634): cosine decay to 10 % of peak after 10 % warmup, clipping 1.0, weight decay 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "Config",
    "DataConfig",
    "DelayConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "TrainConfig",
]


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = "tiny"
    """Model preset name (see ``bubblefree.models.PRESETS``): tiny, small, medium, moe-tiny, smollm2-135m, ..."""

    vocab_size: int = 0
    """Vocabulary size; 0 takes the tokenizer's."""


@dataclass(kw_only=True)
class DataConfig:
    source: str = "embedded"
    """``embedded`` (the vendored public-domain corpus), a path to a text file or folder, a folder of
    nanoGPT-style ``.bin`` shards, or ``hf:NAME`` for a Hugging Face ``datasets`` dataset (optional extra)."""

    tokenizer: str = "bpe"
    """``bpe`` (byte-level BPE trained on first use and cached) or ``byte`` (256 symbols, needs nothing)."""

    vocab_size: int = 8192
    """BPE vocabulary size."""

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

    eval_every: int = 100
    """Evaluate on the validation split every N steps (and at the end); 0 only at the end."""

    eval_batches: int = 8
    """Validation batches per evaluation (fixed, deterministic windows)."""

    log_every: int = 10
    """Write one metrics line every N steps."""

    ckpt_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""

    device: str = "auto"
    """``auto`` (cuda if available), ``cpu`` or ``cuda``."""

    dtype: str = "auto"
    """Compute dtype: ``auto`` (bf16 autocast on GPU, fp32 on CPU), ``float32`` or ``bfloat16``."""


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
    """``none``, ``ef`` (Error Feedback), ``taylor`` (DC-ASGD), ``nesterov`` (Ajanthan et al. 2025)."""

    ef_beta: float = 1.0
    """Error Feedback coefficient beta."""

    taylor_lambda: float = 0.0
    """Taylor (DC-ASGD) coefficient lambda."""

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
