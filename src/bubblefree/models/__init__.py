"""Models: a LLaMA-style decoder (dense or mixture-of-experts), named presets, and the pipeline-stage split."""

from bubblefree.models.hf import to_hf_llama
from bubblefree.models.llama import ModelArgs, Transformer
from bubblefree.models.loss import aux_loss_sum, token_loss
from bubblefree.models.presets import PRESETS, build_model
from bubblefree.models.split import StageModule, param_stages, split_model, stage_layer_ranges

__all__ = [
    "PRESETS",
    "ModelArgs",
    "StageModule",
    "Transformer",
    "build_model",
    "param_stages",
    "split_model",
    "aux_loss_sum",
    "stage_layer_ranges",
    "to_hf_llama",
    "token_loss",
]
