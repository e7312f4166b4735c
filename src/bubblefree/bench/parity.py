"""Device parity checks: what a device computes against a float64 CPU reference, with stated tolerances.

Each check runs one piece of training on ``device`` (``cpu`` or ``cuda``) and the same piece on the CPU in
float64 from the same weights, inputs and gradients, and reports the largest relative error

    err = max over tensors of ||x_device - x_ref|| / ||x_ref||      (Frobenius norms, computed in float64)

next to its tolerance. The reference is float64 so the check measures the device's own rounding (and on
CUDA its kernels), and it is meaningful on the CPU too: ``tests/test_cuda.py`` runs every check on
``cpu`` in the default test run and on ``cuda`` where there is one, and ``bubblefree bench device`` runs them
on the accelerator. A norm-wise error rather than an element-wise one, because sign-based updates (Lion) and
orthogonalisations (Muon, SOAP's eigenbases) may flip single small entries without being wrong.

Tolerances, from the float32 CPU errors measured against this reference (tiny models, 4-12 steps) with a
factor of 10-50 left for other kernels (cuBLAS, SDPA's fused kernels, reductions in another order):

- float32 forward/backward: 1e-4 (measured on CPU: at most 6e-7);
- bf16 autocast forward/backward: 5e-2 on the loss and logits, 2e-1 on the gradients (measured on CPU:
  logits 3e-3, gradients 8e-3; bf16 keeps 8 bits of mantissa, about 4e-3 per rounding, and the gradients
  pass through every layer twice);
- optimizer updates in float32: 1e-4 (measured on CPU: at most 1.3e-6, Muon); SOAP 1e-3, on square
  matrices (see :func:`_square_matrices`; its eigenbases come from ``eigh``/QR, whose rounding differs by
  backend); Muon with a bfloat16 Newton-Schulz (its default on CUDA, as torch's Muon): 5e-2 (measured on
  CPU: 1.3e-2; the quintic iteration does not converge to singular values of exactly 1 but oscillates in
  about [0.7, 1.2], and rounding moves where each lands), checked on every device with ``ns_dtype``
  forced, and on CUDA with the default too;
- DelayedOptimizer with Error Feedback, the weights' change after 4 real training steps: 2e-3 (measured on
  CPU: AdamW 2.6e-4, its first steps' ``m / (sqrt(v) + eps)`` amplify the rounding of gradients near
  ``eps``; Muon 1.2e-5). Muon runs its Newton-Schulz in float32 here: with bfloat16 the weights' change
  differed by 4.9e-2 after 4 steps on the CPU, a property of Muon's iteration, not of the delay;
- checkpoint round trip (a run saved on one device, resumed on the other and back): training losses
  within 1e-3 relative of the uninterrupted run, exactly equal when both devices are the CPU (exact resume
  is the training loop's promise, docs/training.md).
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bubblefree.config import OptimConfig, apply_overrides
from bubblefree.delay import DelayedOptimizer
from bubblefree.models import build_model, token_loss
from bubblefree.optim.base import apply_updates
from bubblefree.optim.registry import OPTIMIZERS, build_optimizer
from bubblefree.train import train
from bubblefree.train.checkpoint import list_checkpoints
from bubblefree.train.presets import get_preset

__all__ = ["CHECKS", "TOL", "checkpoint_roundtrip", "delayed_parity", "model_parity", "optimizer_parity",
           "rel_err", "run_checks"]

VOCAB = 256
"""The checks' models use the byte vocabulary: a 256-wide embedding keeps SOAP's float64 eigenbases small."""

TOL = {
    "float32": 1e-4,
    "bf16_out": 5e-2,
    "bf16_grad": 2e-1,
    "update": 1e-4,
    "update_soap": 1e-3,
    "update_bf16_ns": 5e-2,
    "delayed": 2e-3,
    "resume_cross_device": 1e-3,
}
"""The tolerances of the module docstring."""


def rel_err(x: Tensor, ref: Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 on the CPU (the absolute error when ``ref`` is zero)."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    denom = float(ref.norm())
    return float((x - ref).norm()) / (denom if denom > 0 else 1.0)


def _result(check: str, device: str, errors: dict[str, float], tols: dict[str, float]) -> dict[str, Any]:
    ok = all(errors[k] <= tols[k] for k in errors)
    return {"check": check, "device": device, "errors": errors, "tolerances": tols, "ok": ok}


def _fwd_bwd(model: torch.nn.Module, tokens: Tensor, *, bf16: bool) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    x, y = tokens[:, :-1], tokens[:, 1:]
    ctx = torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16)
    with ctx:
        logits = model(x)
    loss = token_loss(logits, y)
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def model_parity(device: str, *, dtype: str = "float32", preset: str = "llama-1m", batch: int = 2,
                 seq_len: int = 64, seed: int = 0) -> dict[str, Any]:
    """Loss, logits and every parameter's gradient of one forward/backward: ``device`` in ``dtype``
    (``float32`` or ``bfloat16`` autocast) against float64 on the CPU."""
    torch.manual_seed(seed)
    model = build_model(preset, vocab_size=VOCAB)
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq_len + 1),
                           generator=torch.Generator().manual_seed(seed))
    ref_loss, ref_logits, ref_grads = _fwd_bwd(copy.deepcopy(model).double(), tokens, bf16=False)
    bf16 = dtype == "bfloat16"
    loss, logits, grads = _fwd_bwd(copy.deepcopy(model).to(device), tokens.to(device), bf16=bf16)
    errors = {"loss": rel_err(loss, ref_loss), "logits": rel_err(logits, ref_logits),
              "grads": max(rel_err(grads[n], ref_grads[n]) for n in ref_grads)}
    tols = ({"loss": TOL["bf16_out"], "logits": TOL["bf16_out"], "grads": TOL["bf16_grad"]} if bf16
            else dict.fromkeys(errors, TOL["float32"]))
    return _result(f"model {preset} {dtype}", device, errors, tols)


def _update_tol(name: str, device: str, ns_dtype: torch.dtype | None) -> float:
    if name == "soap":
        return TOL["update_soap"]
    if name == "muon" and (ns_dtype == torch.bfloat16 or (ns_dtype is None and device.startswith("cuda"))):
        return TOL["update_bf16_ns"]
    return TOL["update"]


def _square_matrices() -> torch.nn.Module:
    """SOAP's parameters: square matrices (and a vector, which SOAP leaves to Adam). A gradient of a non-square
    matrix makes one Kronecker factor rank-deficient; the eigenbasis inside its null space is arbitrary, so
    two backends (or two dtypes) pick different ones and the next steps' updates differ in earnest (measured:
    0.77 relative between float32 and float64 on the CPU, on llama-1m's shapes). A random square gradient
    gives factors of full rank with distinct eigenvalues: a basis unique up to signs, which SOAP's update
    does not see."""
    shapes = {"wa": (64, 64), "wb": (48, 48), "gain": (64,)}
    return torch.nn.ParameterDict({k: torch.nn.Parameter(torch.randn(s) * 0.02) for k, s in shapes.items()})


def _optimizer_pair(name: str, device: str, ns_dtype: torch.dtype | None, seed: int):
    """The same model on ``device`` (float32) and on the CPU (float64), each with optimizer ``name``
    (SOAP: :func:`_square_matrices`)."""
    torch.manual_seed(seed)
    model = _square_matrices() if name == "soap" else build_model("llama-1m", vocab_size=VOCAB)
    ref, test = copy.deepcopy(model).double(), copy.deepcopy(model).to(device)
    opts = [build_optimizer(m, OptimConfig(name=name)) for m in (ref, test)]
    if name == "muon" and ns_dtype is not None:
        for opt in opts:
            for group in opt.param_groups:
                group["ns_dtype"] = ns_dtype
    return ref, test, opts


def optimizer_parity(device: str, name: str, *, steps: int = 12, ns_dtype: torch.dtype | None = None,
                     seed: int = 0) -> dict[str, Any]:
    """``compute_updates`` over ``steps`` steps of the same random gradients: ``device`` in float32 against
    float64 on the CPU; the updates are applied, so the states stay comparable. ``ns_dtype`` forces Muon's
    Newton-Schulz dtype (None: its default, bfloat16 on CUDA)."""
    ref, test, (ref_opt, test_opt) = _optimizer_pair(name, device, ns_dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    worst = 0.0
    for _ in range(steps):
        for p_ref, p in zip(ref.parameters(), test.parameters()):
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.01
            p_ref.grad, p.grad = g, g.to(device=device, dtype=p.dtype)
        u_ref, u = ref_opt.compute_updates(), test_opt.compute_updates()
        worst = max([worst] + [rel_err(a, b) for a, b in zip(u, u_ref) if b is not None])
        apply_updates(ref_opt.params(), u_ref)
        apply_updates(test_opt.params(), u)
    label = f"compute_updates {name}" + (f" ns={str(ns_dtype).removeprefix('torch.')}" if ns_dtype else "")
    return _result(label, device, {"updates": worst}, {"updates": _update_tol(name, device, ns_dtype)})


def delayed_parity(device: str, name: str, *, correction: str = "ef", steps: int = 4, seed: int = 0,
                   ns_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``DelayedOptimizer`` (delay 1, ``correction``) over ``steps`` real training steps on one fixed batch,
    gradients taken at the stale weights: the weights' change on ``device`` against float64 on the CPU."""
    ref, test, opts = _optimizer_pair(name, device, ns_dtype, seed)
    tokens = torch.randint(0, ref.args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(seed))
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    worst = 0.0
    runs = [(m, DelayedOptimizer(o, delays=1, correction=correction), tokens.to(d))
            for m, o, d in ((ref, opts[0], "cpu"), (test, opts[1], device))]
    for _ in range(steps):
        for model, delayed, batch in runs:
            delayed.zero_grad()
            with delayed.stale_params():
                _fwd_bwd(model, batch, bf16=False)
            delayed.step()
        params = dict(test.named_parameters())
        worst = max([worst] + [rel_err(params[n] - start[n].to(device), p - start[n])
                               for n, p in ref.named_parameters()])
    tol = TOL["update_bf16_ns"] if _update_tol(name, device, ns_dtype) == TOL["update_bf16_ns"] else TOL["delayed"]
    return _result(f"DelayedOptimizer {name} + {correction}", device, {"weights": worst}, {"weights": tol})


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def checkpoint_roundtrip(device_a: str, device_b: str, *, work: str | Path | None = None,
                         steps: int = 6) -> dict[str, Any]:
    """Train the ``smoke`` preset (2BW + Error Feedback, float32) with AdamW for ``steps`` steps on
    ``device_a``, checkpointing every 2; resume its step-2 checkpoint on ``device_b`` and run to the end;
    resume that run's step-4 checkpoint (written on ``device_b``) on ``device_a`` again. The resumed runs'
    training losses are compared with the uninterrupted run's: exactly equal on one device type, within 1e-3
    across two. AdamW rather than the preset's Muon, whose bfloat16 Newton-Schulz on CUDA would differ from
    the CPU's float32 by more than any checkpoint fault worth finding."""
    config = apply_overrides(get_preset("smoke"), {
        "train.steps": steps, "train.ckpt_every": 2, "train.ckpt_keep": steps, "train.log_every": 1,
        "train.eval_every": 0, "train.eval_batches": 1, "train.dtype": "float32", "log.progress": False,
        "optim.name": "adamw"})
    on = lambda dev: apply_overrides(config, {"train.device": dev.split(":")[0]})  # noqa: E731
    own = work is None
    root = Path(tempfile.mkdtemp(prefix="bubblefree-parity-") if own else work)
    try:
        first, there, back = root / "a", root / "a-b", root / "a-b-a"
        train(on(device_a), out_dir=first)
        shutil.copytree(first, there)
        ckpts = dict(list_checkpoints(there))
        # Each copy goes back to an older checkpoint of a finished run: a branch (its later steps set aside).
        train(on(device_b), out_dir=there, resume=ckpts[2], branch=True)
        shutil.copytree(there, back)
        train(on(device_a), out_dir=back, resume=dict(list_checkpoints(back))[4], branch=True)
        ref, errors = _losses(first), {}
        for label, run_dir, after in (("resumed on b", there, 2), ("back on a", back, 4)):
            got = _losses(run_dir)
            errors[label] = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref if s > after)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    same = device_a.split(":")[0] == device_b.split(":")[0]
    tol = 0.0 if same else TOL["resume_cross_device"]
    return _result(f"checkpoint {device_a} -> {device_b} -> {device_a}", f"{device_a},{device_b}", errors,
                   dict.fromkeys(errors, tol))


def _checks(device: str) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """Every check of the module on ``device``, by name, as zero-argument calls."""
    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("model float32", lambda: model_parity(device, dtype="float32")),
        ("model bfloat16", lambda: model_parity(device, dtype="bfloat16")),
        ("model moe float32", lambda: model_parity(device, dtype="float32", preset="moe-1m")),
    ]
    for name in OPTIMIZERS:
        checks.append((f"optimizer {name}", lambda name=name: optimizer_parity(device, name)))
    for dtype in (torch.float32, torch.bfloat16):
        checks.append((f"optimizer muon ns {dtype}",
                       lambda dtype=dtype: optimizer_parity(device, "muon", ns_dtype=dtype)))
    checks.append(("delayed adamw ef", lambda: delayed_parity(device, "adamw")))
    checks.append(("delayed muon ef", lambda: delayed_parity(device, "muon", ns_dtype=torch.float32)))
    checks.append(("checkpoint", lambda: checkpoint_roundtrip(device, "cpu")))
    return checks


CHECKS = tuple(name for name, _ in _checks("cpu"))
"""The names :func:`run_checks` reports, in order."""


def run_checks(device: str, *, on_result: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run every check on ``device``; a check that raises is reported as failed with its error, and the
    others still run. ``on_result`` sees each result as soon as it is known."""
    results = []
    for name, check in _checks(device):
        try:
            result = check()
        except Exception as e:  # noqa: BLE001 - a device check reports, it does not stop the others
            result = {"check": name, "device": device, "ok": False, "error": f"{type(e).__name__}: {e}"}
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
