"""Training throughput of our ``Transformer`` against Hugging Face ``LlamaForCausalLM`` of identical shape.

One step = forward + cross-entropy + backward + fused ``torch.optim.AdamW`` step (the same optimizer for
both, so the comparison is of the models). The two models alternate step by step in the same process and we
report medians, so load from other processes on a shared machine hits both alike. Also measured: the
machine's float32 matmul rate (median over square ``n x n`` matmuls, ``2 n^3`` flops each), and the model
FLOP utilisation (MFU) against it.

Model FLOPs per token (PaLM's MFU definition, Chowdhery et al. 2022, appendix B):

    6 * N + 12 * L * d_attn * T

``N`` counts the parameters one token multiplies by (active ones for MoE; the output head included even when
tied, the embedding lookup excluded), ``L`` layers, ``d_attn = n_heads * head_dim``, ``T`` the sequence
length. The attention term counts the full ``T x T`` score matrix although a causal kernel computes about
half, as PaLM does. On CUDA the same comparison runs ``smollm2-135m`` under bf16 autocast, and MFU is against
the dense bf16 peak of an H100/H200 (989 TFLOPS).

    python -m bubblefree.bench.train [OUT.json | OUT_DIR]      # or: bubblefree bench train --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bubblefree.models import build_model, to_hf_llama, token_loss
from bubblefree.models.llama import Transformer

__all__ = ["H100_BF16_PEAK_FLOPS", "flops_per_token", "matmul_flops", "run"]

H100_BF16_PEAK_FLOPS = 989e12
"""Dense bf16 tensor-core peak of an H100/H200 SXM (NVIDIA datasheet, without sparsity)."""


def flops_per_token(model: Transformer, seq_len: int) -> float:
    """``6 N + 12 L d_attn T`` training FLOPs per token (module docstring)."""
    a = model.args
    n = model.num_params(active=True) - model.embed.weight.numel()  # an untied head is already counted
    if model.lm_head.weight is model.embed.weight:  # a tied one was counted once, as the embedding just removed
        n += model.lm_head.weight.numel()
    return 6.0 * n + 12.0 * a.n_layers * a.n_heads * a.head_dim * seq_len


def matmul_flops(*, n: int = 2048, repeats: int = 7, device: str = "cpu", dtype=torch.float32) -> float:
    """Median rate (FLOP/s) of an ``n x n`` by ``n x n`` matmul, the practical peak the MFU is measured against."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        if i:  # the first call warms up
            times.append(time.perf_counter() - start)
    return 2.0 * n**3 / statistics.median(times)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _step_fn(model: torch.nn.Module, tokens: torch.Tensor, *, device: str, autocast: bool,
             peaks: list[int] | None = None) -> Callable[[], float]:
    """One timed training step of ``model`` (ours returns logits, HF an output object with ``.logits``). On
    CUDA each step appends to ``peaks`` the most memory it held above what was allocated before it (the
    activations, gradients and optimizer temporaries: the weights and optimizer states of both models stay
    resident throughout and are left out)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # fastest path on CPU and CUDA, both models
    x, y = tokens[:, :-1], tokens[:, 1:]
    cuda = device.startswith("cuda")

    def step() -> float:
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        ctx = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            out = model(x)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        token_loss(logits, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        elapsed = time.perf_counter() - start
        if cuda and peaks is not None:
            peaks.append(torch.cuda.max_memory_allocated() - before)
        return elapsed

    return step


def _compare(preset: str, *, batch: int, seq_len: int, steps: int, warmup: int, device: str, autocast: bool,
             peak: float, compile_backend: str | None = None, per_block: bool = False) -> dict:
    """One row: ours and HF alternating step by step; ``compile_backend`` (e.g. ``inductor``) wraps both
    models in ``torch.compile`` first (the first warmup step, which compiles, is reported apart). With
    ``per_block`` the row has four models instead, alternating: ours and HF eager, and copies of both with
    every transformer block compiled (``train.compile``'s recipe), as ``ours_compiled`` / ``hf_compiled``."""
    torch.manual_seed(0)
    ours = build_model(preset, device=device)
    theirs = to_hf_llama(ours).to(device)
    theirs.config.use_cache = False  # training: no key/value cache (with one, dynamo recompiles HF's compiled
    # blocks once per layer index, past its limit of 8)
    tokens = torch.randint(0, ours.args.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    models = {"ours": ours, "hf": theirs}
    if compile_backend is not None and per_block:
        ours_c = copy.deepcopy(ours)
        theirs_c = to_hf_llama(ours_c).to(device)
        theirs_c.config.use_cache = False
        for block in [*ours_c.layers, *theirs_c.model.layers]:
            block.compile(backend=compile_backend)
        models.update(ours_compiled=ours_c, hf_compiled=theirs_c)
    elif compile_backend is not None:
        models = {k: torch.compile(m, backend=compile_backend) for k, m in models.items()}
    peaks: dict[str, list[int]] = {k: [] for k in models}
    steps_fns = {k: _step_fn(m, tokens, device=device, autocast=autocast, peaks=peaks[k]) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in steps_fns}
    first: dict[str, float] = {}
    for i in range(warmup + steps):  # interleaved: ours, HF, ours, HF, ...
        for name, fn in steps_fns.items():
            t = fn()
            first.setdefault(name, t)
            if i >= warmup:
                times[name].append(t)
    tokens_per_step = batch * seq_len
    fpt = flops_per_token(ours, seq_len)
    row = {"preset": preset, "device": device, "dtype": "bf16-autocast" if autocast else "fp32",
           "compile": (f"eager vs torch.compile ({compile_backend}) per block" if per_block else
                       f"torch.compile ({compile_backend})" if compile_backend else "eager"),
           "params": ours.num_params(), "batch": batch,
           "seq_len": seq_len, "steps": steps, "flops_per_token": fpt, "peak_flops": peak}
    for name, ts in times.items():
        median = statistics.median(ts)
        row[f"{name}_step_s"] = median
        row[f"{name}_first_step_s"] = first[name]
        row[f"{name}_tokens_per_s"] = tokens_per_step / median
        row[f"{name}_mfu"] = fpt * tokens_per_step / median / peak
        if peaks[name]:
            row[f"{name}_step_peak_bytes"] = max(peaks[name])
    if device.startswith("cuda"):
        row["resident_bytes"] = torch.cuda.memory_allocated()  # both models' weights and AdamW states
    row["ratio"] = row["ours_tokens_per_s"] / row["hf_tokens_per_s"]
    if "ours_compiled" in times:
        row["ours_compile_speedup"] = row["ours_compiled_tokens_per_s"] / row["ours_tokens_per_s"]
        row["hf_compile_speedup"] = row["hf_compiled_tokens_per_s"] / row["hf_tokens_per_s"]
    return row


def _print_table(rows: list[dict]) -> None:
    head = f"{'preset':<14}{'device':<7}{'dtype':<15}{'params':>8}{'tokens':>8}{'ours tok/s':>12}{'HF tok/s':>11}" \
           f"{'ours/HF':>9}{'MFU ours':>10}{'MFU HF':>9}"
    print(head)
    for r in rows:
        print(f"{r['preset']:<14}{r['device']:<7}{r['dtype']:<15}{r['params'] / 1e6:>7.1f}M"
              f"{r['batch'] * r['seq_len']:>8}{r['ours_tokens_per_s']:>12.0f}{r['hf_tokens_per_s']:>11.0f}"
              f"{r['ratio']:>9.3f}{r['ours_mfu']:>10.1%}{r['hf_mfu']:>9.1%}")
        if "ours_compiled_tokens_per_s" in r:
            print(f"{'':<36}per-block compiled: ours {r['ours_compiled_tokens_per_s']:.0f} tok/s "
                  f"({r['ours_compile_speedup']:.3f}x eager, MFU {r['ours_compiled_mfu']:.1%}), HF "
                  f"{r['hf_compiled_tokens_per_s']:.0f} tok/s ({r['hf_compile_speedup']:.3f}x eager, "
                  f"MFU {r['hf_compiled_mfu']:.1%})")


def run(out: Path | None = None, *, presets: tuple[str, ...] = ("llama-5m", "llama-20m"), steps: int = 6,
        warmup: int = 2, batch: int = 8, seq_len: int = 256, threads: int | None = 2,
        cuda_preset: str = "smollm2-135m", cuda_batch: int = 16, cuda_seq_len: int = 2048,
        compile_blocks: bool = False) -> dict:
    """Measure, print the table, and write JSON to ``out`` (a ``.json`` file, or a folder that gets
    ``bench_train.json``) when given. ``threads`` sets ``torch.set_num_threads`` for the CPU part;
    ``compile_blocks`` also times block-compiled copies of both models in the CPU rows (``per_block``)."""
    if threads is not None:
        torch.set_num_threads(threads)
    cpu_peak = matmul_flops()
    print(f"fp32 matmul (2048^3, median of 7, {torch.get_num_threads()} threads): {cpu_peak / 1e9:.1f} GFLOP/s")
    rows = [_compare(p, batch=batch, seq_len=seq_len, steps=steps, warmup=warmup, device="cpu", autocast=False,
                     peak=cpu_peak, compile_backend="inductor" if compile_blocks else None,
                     per_block=compile_blocks) for p in presets]
    # On a shared machine the load changes during the run: the peak is the best rate seen, before or after.
    cpu_peak = max(cpu_peak, matmul_flops())
    for row in rows:
        for name in ("ours", "hf", "ours_compiled", "hf_compiled"):
            if f"{name}_mfu" in row:
                row[f"{name}_mfu"] *= row["peak_flops"] / cpu_peak
        row["peak_flops"] = cpu_peak
    print(f"fp32 matmul after the runs: best {cpu_peak / 1e9:.1f} GFLOP/s (the MFU reference)")
    result: dict = {"threads": torch.get_num_threads(), "cpu_matmul_flops": cpu_peak, "rows": rows,
                    "flops_formula": "6*N_active(+head, -embedding) + 12*L*n_heads*head_dim*T per token"}
    if torch.cuda.is_available():
        result["cuda_device"] = torch.cuda.get_device_name()
        result["cuda_bf16_matmul_flops"] = matmul_flops(n=8192, device="cuda", dtype=torch.bfloat16)
        rows.append(_compare(cuda_preset, batch=cuda_batch, seq_len=cuda_seq_len, steps=steps, warmup=warmup,
                             device="cuda", autocast=True, peak=H100_BF16_PEAK_FLOPS))
        print(f"{result['cuda_device']}: bf16 matmul (8192^3) {result['cuda_bf16_matmul_flops'] / 1e12:.0f} TFLOP/s; "
              f"MFU below is against the {H100_BF16_PEAK_FLOPS / 1e12:.0f} TFLOPS datasheet peak")
    _print_table(rows)
    if out is not None:
        out = Path(out)
        path = out if out.suffix == ".json" else out / "bench_train.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="a .json file or a folder for bench_train.json")
    parser.add_argument("--presets", default="llama-5m,llama-20m", help="comma-separated model presets")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile-blocks", action="store_true",
                        help="also time block-compiled copies of both models, alternating with the eager ones")
    a = parser.parse_args()
    run(a.out, presets=tuple(a.presets.split(",")), batch=a.batch, seq_len=a.seq_len, steps=a.steps,
        threads=a.threads, compile_blocks=a.compile_blocks)
