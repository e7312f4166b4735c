"""Optimizer step time, ours versus its reference, side by side in one run; state memory per parameter.

About 10M parameters of transformer-shaped float32 matrices (three blocks of width 512,
``[(1536,512),(512,512),(2048,512),(512,2048)] x 3 + (1024,512)``) plus a few 1-D norms; fresh random
gradients each step; ``step()`` timed with the implementations interleaved so machine noise hits both
alike; medians. CPU runs with 2 threads (the CI size; ``--threads``); the same table runs on CUDA when one is present.

    python -m bubblefree.bench.optim [--out DIR] [--steps N] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from bubblefree.optim.registry import OPTIMIZERS

__all__ = ["MATRIX_SHAPES", "VECTOR_SHAPES", "run"]

MATRIX_SHAPES = [(1536, 512), (512, 512), (2048, 512), (512, 2048)] * 3 + [(1024, 512)]
"""13 matrices, 9.96M parameters: three blocks of a d=512 transformer plus an output-sized matrix."""

VECTOR_SHAPES = [(512,)] * 6


def _fp32_bf16(self, *args, **kwargs):
    return self.float()


def _defaults(name: str) -> dict:
    """Our class defaults (the registry's) for a reference: lr, weight decay and the momentum coefficients. Where a
    reference's own defaults differ (pytorch-optimizer's Lion, Adan and MARS default to no weight decay, which would
    skip whole passes) the comparison would not be like for like."""
    spec = OPTIMIZERS[name]
    return {"lr": spec.lr, "weight_decay": spec.weight_decay, **spec.momentum_kwargs(spec.momentum)}


def _muon_ref(params, ns_fp32: bool):
    opt = torch.optim.Muon(params, **_defaults("muon"))
    if ns_fp32:  # torch's own NS code with bf16 replaced by fp32 (this CPU has no fast bf16 matmul)
        step = opt.step
        def fp32_step(closure=None):  # noqa: E306
            with mock.patch.object(torch.Tensor, "bfloat16", _fp32_bf16):
                return step(closure)
        opt.step = fp32_step
    return opt


def _reference(name: str, **options):
    """The registry's reference implementation of ``name`` at our class defaults (``options``: torch's ``fused``
    and the like)."""
    return lambda ps: OPTIMIZERS[name].reference(ps, **_defaults(name), **options)


def _pairs(device: torch.device):
    """name -> (ours(params), reference(params), reference label); matrices only for Muon, like its reference.
    Ours and the reference run at the registry's defaults (the classes' own)."""
    cpu = device.type == "cpu"
    ours = lambda name: OPTIMIZERS[name].cls  # noqa: E731
    return {
        "adamw": (ours("adamw"), _reference("adamw"), "torch AdamW foreach"),
        "adamw (vs fused)": (ours("adamw"), lambda ps: torch.optim.AdamW(ps, **_defaults("adamw"), fused=True),
                             "torch AdamW fused"),
        "muon": (ours("muon"), lambda ps: _muon_ref(ps, ns_fp32=cpu), "torch Muon" + (" (fp32 NS)" if cpu else "")),
        "lion": (ours("lion"), _reference("lion"), "pytorch-optimizer Lion"),
        "adan": (ours("adan"), _reference("adan"), "pytorch-optimizer Adan (proximal decay)"),
        "mars": (ours("mars"), _reference("mars"), "pytorch-optimizer MARS"),
        "soap": (ours("soap"), _reference("soap"), "pytorch-optimizer SOAP"),
        "nadamw": (ours("nadamw"), _reference("nadamw"), "torch NAdam decoupled foreach"),
    }


def _tensors(value) -> list[torch.Tensor]:
    """Tensors in one state value: a tensor, or tensors nested in lists, tuples and dicts (SOAP's GG and Q)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _state_bytes_per_param(opt: torch.optim.Optimizer, n_params: int) -> float:
    """Bytes of optimizer state per parameter; 0-d tensors (step counters) are left out."""
    total = sum(t.numel() * t.element_size() for s in opt.state.values() for t in _tensors(s) if t.ndim > 0)
    return total / n_params


def run(out: Path | None = None, *, steps: int = 12, warmup: int = 3, threads: int = 2,
        devices: tuple[str, ...] | None = None, matrix_shapes: list[tuple[int, ...]] = MATRIX_SHAPES,
        vector_shapes: list[tuple[int, ...]] = VECTOR_SHAPES, names: tuple[str, ...] | None = None) -> dict:
    """Time every pair on CPU (and CUDA if available), print the tables, write ``optim.json`` under ``out``.

    ``threads``: CPU threads (2, the CI size; 1 avoids OpenMP stalls when the machine is oversubscribed).
    ``devices`` (e.g. ``("cuda",)``) replaces the default list; the shapes replace the ~10M-parameter set;
    ``names`` keeps only those rows of the table."""
    devices = [torch.device(d) for d in devices] if devices else (
        [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else []))
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    results: dict = {"shapes": matrix_shapes + vector_shapes, "steps": steps, "threads": threads, "devices": {}}
    try:
        for device in devices:
            rows = []
            for name, (ours_f, ref_f, label) in _pairs(device).items():
                if names is not None and name not in names:
                    continue
                shapes = matrix_shapes if name == "muon" else matrix_shapes + vector_shapes
                gen = torch.Generator(device=device).manual_seed(0)
                sets = [[nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes]
                        for _ in range(2)]
                opts = [ours_f(sets[0]), ref_f(sets[1])]
                times: list[list[float]] = [[], []]
                for i in range(steps + warmup):
                    grads = [torch.randn(s, device=device, generator=gen) for s in shapes]
                    for k in (0, 1) if i % 2 == 0 else (1, 0):  # alternate who goes first
                        for p, g in zip(sets[k], grads):
                            p.grad = g.clone()
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        opts[k].step()
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        if i >= warmup:
                            times[k].append(time.perf_counter() - t0)
                n = sum(p.numel() for p in sets[0])
                ours_ms, ref_ms = (statistics.median(t) * 1e3 for t in times)
                rows.append(dict(optimizer=name, reference=label, ours_ms=ours_ms, ref_ms=ref_ms,
                                 ratio=ours_ms / ref_ms, params=n,
                                 state_bytes_per_param=_state_bytes_per_param(opts[0], n),
                                 ref_state_bytes_per_param=_state_bytes_per_param(opts[1], n)))
            results["devices"][device.type] = rows
            print(f"\n{device.type}, {torch.get_num_threads()} threads, median of {steps} steps, ms per step()")
            print(f"{'optimizer':18} {'ours':>8} {'reference':>10} {'ratio':>6} {'state B/param':>14}  reference")
            for r in rows:
                print(f"{r['optimizer']:18} {r['ours_ms']:8.1f} {r['ref_ms']:10.1f} {r['ratio']:6.2f} "
                      f"{r['state_bytes_per_param']:6.1f} ({r['ref_state_bytes_per_param']:4.1f})  {r['reference']}")
    finally:
        torch.set_num_threads(saved_threads)
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "optim.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    run(args.out, steps=args.steps, threads=args.threads)
