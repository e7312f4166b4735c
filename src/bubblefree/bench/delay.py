"""What delay and Error Feedback cost: memory held by the wrapper, and step time over the bare optimizer step.

*Memory.* On the ``llama-20m`` preset with AdamW, after enough steps for every ring to fill, the bytes held by
:class:`~bubblefree.delay.DelayedOptimizer` for delay 1 and 2 with EF: ``d`` stashed versions plus ``d``
update buffers, i.e. exactly ``2 d`` times the parameter bytes, nothing more.

*Step time.* 13 transformer-shaped fp32 matrices (:data:`SHAPES`: model width 512, 9.96M parameters). For AdamW and
Muon, three copies run side by side: the bare ``opt.step()``, delay 1, and delay 1 + EF, each timed over ``with
stale_params(): pass`` plus ``step()`` (the swaps and the update; the forward and backward are the same in all
three and are not run). Fresh random gradients each step, the same
for all copies. The copies alternate step by step so load from other processes hits all alike; medians.

    python -m bubblefree.bench.delay [OUT.json | OUT_DIR [THREADS]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from bubblefree.delay import DelayedOptimizer
from bubblefree.models import build_model
from bubblefree.optim import AdamW, Muon

__all__ = ["SHAPES", "memory", "run", "step_times"]

SHAPES: tuple[tuple[int, int], ...] = ((1536, 512), (512, 512), (2048, 512), (512, 2048)) * 3 + ((1024, 512),)
"""Three transformer blocks of width 512 (fused QKV, attention output, MLP up and down) plus one 1024 x 512."""


def _fake_grads(params: list[nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype).mul_(1e-2)


def memory(preset: str = "llama-20m") -> dict:
    """Bytes held by the stash and EF rings, as multiples of the parameter bytes, for delay 1 and 2."""
    torch.manual_seed(0)
    params = list(build_model(preset).parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    rows = {}
    for d in (1, 2):
        delayed = DelayedOptimizer(AdamW(params, lr=1e-4), delays=d, correction="ef")
        for t in range(d + 1):
            _fake_grads(params, t)
            delayed.step()
        held = delayed.memory_bytes()
        rows[f"d={d}+ef"] = {k: v / param_bytes for k, v in held.items()} | {"bytes": sum(held.values())}
    return {"preset": preset, "params": sum(p.numel() for p in params), "param_bytes": param_bytes, "held": rows}


def _copies(make_opt: Callable[[list], torch.optim.Optimizer]) -> dict[str, tuple[list, Callable[[], None]]]:
    torch.manual_seed(0)
    init = [torch.randn(s) * 0.02 for s in SHAPES]
    out = {}
    for name, kw in (("bare", None), ("delay1", dict(delays=1)), ("delay1+ef", dict(delays=1, correction="ef"))):
        params = [nn.Parameter(x.clone()) for x in init]
        opt = make_opt(params)
        if kw is None:
            out[name] = (params, opt.step)
        else:
            delayed = DelayedOptimizer(opt, **kw)

            def step(delayed=delayed):
                with delayed.stale_params():
                    pass
                delayed.step()

            out[name] = (params, step)
    return out


def step_times(steps: dict[str, int] | None = None, warmup: int = 3) -> dict:
    """Median ms per step of the bare optimizer, delay 1 and delay 1 + EF, for AdamW and Muon."""
    steps = {"adamw": 25, "muon": 7} if steps is None else steps
    makers = {"adamw": lambda ps: AdamW(ps, lr=1e-3), "muon": lambda ps: Muon(ps, lr=0.02)}
    result = {}
    for name, make in makers.items():
        if not steps.get(name):
            continue
        copies = _copies(make)
        times: dict[str, list[float]] = {k: [] for k in copies}
        for t in range(warmup + steps[name]):
            for key, (params, step) in copies.items():
                _fake_grads(params, 100 + t)
                start = time.perf_counter()
                step()
                if t >= warmup:
                    times[key].append(1e3 * (time.perf_counter() - start))
        med = {k: statistics.median(v) for k, v in times.items()}
        result[name] = {"ms": med, "overhead": {k: med[k] / med["bare"] - 1 for k in med if k != "bare"}}
    return result


def run(out: Path | None = None, *, steps: dict[str, int] | None = None, threads: int | None = None) -> dict:
    """Measure, print both tables, and write JSON to ``out`` (a ``.json`` file or a folder) when given.

    ``threads`` sets ``torch.set_num_threads`` (on a loaded machine 1 thread avoids OpenMP oversubscription)."""
    if threads:
        torch.set_num_threads(threads)
    result = {"threads": torch.get_num_threads(), "memory": memory(), "step": step_times(steps)}
    mem = result["memory"]
    print(f"memory held by DelayedOptimizer, {mem['preset']} ({mem['params'] / 1e6:.1f}M params, "
          f"{mem['param_bytes'] / 2**20:.1f} MiB), as multiples of the parameter bytes:")
    print(f"{'config':<10} {'stash':>6} {'ef':>6} {'MiB':>8}")
    for key, row in mem["held"].items():
        print(f"{key:<10} {row['stash']:>6.2f} {row['ef']:>6.2f} {row['bytes'] / 2**20:>8.1f}")
    print(f"\nstep time, {sum(a * b for a, b in SHAPES) / 1e6:.2f}M params, {result['threads']} threads "
          f"(median ms; overhead over the bare step):")
    print(f"{'optimizer':<9} {'bare':>8} {'delay1':>16} {'delay1+ef':>16}")
    for name, row in result["step"].items():
        ms, over = row["ms"], row["overhead"]
        cells = [f"{ms[k]:8.1f} ({100 * over[k]:+5.1f}%)" for k in ("delay1", "delay1+ef")]
        print(f"{name:<9} {ms['bare']:>8.1f} {cells[0]:>16} {cells[1]:>16}")
    if out is not None:
        out = Path(out)
        path = out if out.suffix == ".json" else out / "bench_delay.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="a .json file or a folder for bench_delay.json")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    run(args.out, threads=args.threads)
