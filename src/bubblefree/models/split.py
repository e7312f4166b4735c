"""Cut a ``Transformer`` into pipeline stages that share its parameters.

Both the single-process simulation and the distributed runtime use this one split, so a parameter's stage
(and hence its delay, docs/spec.md section 4) is defined once.

Balancing rule (``stage_layer_ranges``): stages get contiguous blocks of ``n_layers // P`` layers each; the
``n_layers % P`` leftover layers go one each to the middle stages ``1, 2, ..., P-2`` first, then to stage 0,
and never to the last stage, because stage 0 also holds the embedding and the last stage the final norm, the
output projection and the loss (the largest single matmul at a realistic vocabulary).
"""

from __future__ import annotations

from torch import Tensor, nn

from bubblefree.models.llama import Transformer, forward_span

__all__ = ["StageModule", "param_stages", "split_model", "stage_layer_ranges"]


def stage_layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, balanced as the module docstring states.

    >>> stage_layer_ranges(10, 4)
    [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    """
    if n_layers < 1:
        raise ValueError(f"Invalid n_layers: {n_layers} (must be >= 1)")
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"Invalid n_stages: {n_stages} (must be between 1 and n_layers = {n_layers})")
    sizes = [n_layers // n_stages] * n_stages
    for stage in [*range(1, n_stages - 1), 0][: n_layers % n_stages]:
        sizes[stage] += 1
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


class StageModule(nn.Module):
    """One pipeline stage: a contiguous span of ``model`` holding the model's own submodules (not copies).

    Stage 0 holds ``embed`` and maps tokens ``[B, T]`` to hidden states; the last stage holds ``norm`` and
    ``lm_head`` and returns float32 logits; middle stages map hidden states to hidden states. ``layers`` is a
    ``ModuleDict`` keyed by the original layer index, so parameter names are the whole model's
    (``layers.3.attn.wq.weight``) and a stage's ``state_dict`` loads straight into the model.
    """

    def __init__(self, model: Transformer, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.args = model.args
        self.layer_range = layers
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    @property
    def is_first(self) -> bool:
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def forward(self, x: Tensor) -> Tensor:
        return forward_span(
            x, args=self.args, embed=self.embed, layers=list(self.layers.values()), norm=self.norm, lm_head=self.lm_head
        )


def split_model(model: Transformer, n_stages: int) -> list[StageModule]:
    """``n_stages`` stage modules over ``model``'s own parameters; running them in order is ``model.forward``.

    With tied embeddings the last stage's ``lm_head.weight`` is the very Parameter of stage 0's ``embed``. In
    one process that is exact weight tying; a runtime that places stages in different processes must keep the
    copies in sync itself (it is listed under stage 0 by ``param_stages``).
    """
    ranges = stage_layer_ranges(model.args.n_layers, n_stages)
    return [StageModule(model, r, first=s == 0, last=s == n_stages - 1) for s, r in enumerate(ranges)]


def param_stages(model: Transformer, n_stages: int) -> dict[str, int]:
    """Stage of every parameter, keyed by its name in ``model.named_parameters()``.

    A tied embedding/head weight appears there once, as ``embed.weight``, and belongs to stage 0.
    """
    stages: dict[str, int] = {}
    for s, stage in enumerate(split_model(model, n_stages)):
        for name, _ in stage.named_parameters():
            stages.setdefault(name, s)
    assert stages.keys() >= {name for name, _ in model.named_parameters()}
    return {name: stages[name] for name, _ in model.named_parameters()}
