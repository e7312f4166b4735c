"""``bubblefree bench device``: the accelerator check, one command, at most 8 minutes on one H100/H200.

Five parts, each in its own process with its own time budget, under one global deadline:

- ``checks``: :mod:`bubblefree.bench.parity` on CUDA: the model's forward/backward (float32 and bf16
  autocast), every optimizer's ``compute_updates``, ``DelayedOptimizer`` with Error Feedback, and a
  checkpoint saved on CUDA, resumed on the CPU and back, against a float64 CPU reference with stated
  tolerances (the same functions ``tests/test_cuda.py`` runs);
- ``memory``: ``bubblefree plan``'s activation bytes (float32, and its bfloat16 estimate of autocast) against
  the tensors autograd saves in a real forward on CUDA at the ``gpu`` scale's shapes, within 10 %;
- ``optim``: ``bench optim`` on CUDA, our optimizers against their references (Muon's batched
  Newton-Schulz against ``torch.optim.Muon``);
- ``quality``: the ``gpu`` reproduction scale's run (SmolLM2-135M shapes, BPE 8192, 32 x 512 tokens per
  step) as sync, 2BW and 2BW + Error Feedback with Muon and with AdamW, one seed, at the registry learning
  rates, for as many steps as fit the budget (a 30-step calibration run measures the step time first);
- ``train``: ``bench train``'s comparison at ``smollm2-135m`` (16 x 2048 tokens, bf16 autocast), ours
  against Hugging Face ``LlamaForCausalLM`` of the same shape and weights, eager and with every block
  under ``torch.compile`` (``train.compile``'s recipe):
  tokens/s, MFU against the 989 TFLOPS bf16 peak and against the measured bf16 matmul rate, memory.

A part that fails, or outlives its budget (its process group is killed), is recorded as such in the JSON and
the others still run; a part whose budget the deadline has eaten is recorded as skipped. A part writes its
results as they come (``parts/<part>.json``, merged into ``device.json`` and removed when the part ends), and
``device.json`` and ``device.md`` are rewritten after each part, so a session cut short keeps what finished;
the parts' output goes to one ``device.log``. A SIGTERM or Ctrl-C ends the running part's process group too.
``--tiny`` runs the same five parts on the CPU with tiny sizes (``torch.compile`` with the ``eager`` backend:
dynamo without code generation) in well under a minute; the test suite runs it. Exit code 0 when every part
passed, 1 otherwise (after writing everything).

    bubblefree bench device --out DIR [--tiny]      # DIR/device.json, DIR/device.md, DIR/device.log
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from bubblefree import __version__
from bubblefree.bench.device_report import summary_markdown
from bubblefree.errors import UserError
from bubblefree.experiments.runner import commit

__all__ = ["BUDGETS_S", "DEADLINE_S", "PARTS", "run"]

PARTS = ("checks", "memory", "optim", "quality", "train")
"""In the order they run: cheap and essential first, ``torch.compile`` (the likeliest to be slow) last."""

BUDGETS_S = {"checks": 60.0, "memory": 30.0, "optim": 50.0, "quality": 160.0, "train": 170.0}
"""Each part's wall-clock budget on the accelerator, process start-up included."""

TINY_BUDGETS_S = {"checks": 90.0, "memory": 60.0, "optim": 60.0, "quality": 90.0, "train": 90.0}
"""``--tiny`` budgets: generous, for a loaded CPU; an idle one needs a few seconds per part."""

DEADLINE_S = 470.0
"""The whole command's deadline: under 8 minutes, with the reports' writing to spare."""

MIN_PART_S = 20.0
"""A part is skipped when less than this is left before the deadline."""


# ------------------------------------------------------------------------------------------ the parts
# Each runs in a child process: ``part(budget_s, tiny, record) -> dict``; ``record(partial)`` saves what is
# known so far, so a part killed at its budget still reports its finished pieces. ``"ok"`` in the result says
# whether the part passed. A part imports what it runs inside its function: each part is a fresh process
# with a budget, which should not pay for the other parts' modules (transformers, the optimizer references,
# the experiments).

def _checks(budget_s: float, tiny: bool, record: Callable[[dict], None]) -> dict:
    from bubblefree.bench.parity import run_checks

    results: list[dict] = []

    def seen(r: dict) -> None:
        results.append(r)
        record({"results": results})
        print(f"{r['check']} on {r['device']}: {'ok' if r['ok'] else 'FAILED'} {r.get('errors', r.get('error'))}",
              flush=True)

    run_checks("cpu" if tiny else "cuda", on_result=seen)
    return {"results": results, "ok": all(r["ok"] for r in results)}


MEMORY_TOL = 0.10
"""``memory``: the plan's activation bytes may differ from the device's saved tensors by this share."""


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> int:
    """What autograd keeps from a forward to its backward on the device: every saved tensor's storage (by
    address, parameters excluded), the input and the loss; bf16 autocast's weight copies included."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    from bubblefree.models import token_loss

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = token_loss(model(x), y)
    for t in (x, loss):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(kept.values())


def _memory(budget_s: float, tiny: bool, record: Callable[[dict], None]) -> dict:
    """``bubblefree plan``'s activation account (a meta-device forward: float32, or the stage converted to
    bfloat16 as its estimate of autocast) against the tensors a real forward saves on the device, bf16
    autocast and float32, one whole-model stage. The gpu scale's shapes: vocabulary 8192, 16 x 2048."""
    from bubblefree.models import build_model
    from bubblefree.models.split import split_model
    from bubblefree.train.memory import activation_bytes

    device, preset, vocab, batch, seq_len = (("cpu", "llama-1m", 256, 16, 256) if tiny else
                                             ("cuda", "smollm2-135m", 8192, 16, 2048))
    torch.manual_seed(0)
    model = build_model(preset, vocab_size=vocab, device=device)
    meta = split_model(build_model(preset, vocab_size=vocab, device="meta"), 1)[0]
    x, y = (torch.randint(0, vocab, (batch, seq_len), device=device) for _ in range(2))
    out: dict[str, Any] = {"preset": preset, "vocab_size": vocab, "batch": batch, "seq_len": seq_len,
                           "tolerance": MEMORY_TOL, "rows": []}
    for dtype in ("bfloat16", "float32"):
        planned = (activation_bytes(copy.deepcopy(meta).to(torch.bfloat16), batch=batch, seq_len=seq_len,
                                    dtype=torch.bfloat16)  # .to() converts in place: a copy
                   if dtype == "bfloat16" else activation_bytes(meta, batch=batch, seq_len=seq_len))
        measured = _saved_bytes(model, x, y, autocast=dtype == "bfloat16")
        out["rows"].append({"dtype": "bf16 autocast" if dtype == "bfloat16" else "float32", "planned": planned,
                            "measured": measured, "ratio": planned / measured,
                            "ok": abs(planned / measured - 1) <= MEMORY_TOL})
        record(out)
        if device == "cuda":
            torch.cuda.empty_cache()
    return {**out, "ok": all(r["ok"] for r in out["rows"])}


def _optim(budget_s: float, tiny: bool, record: Callable[[dict], None]) -> dict:
    from bubblefree.bench import optim

    names = None if importlib.util.find_spec("pytorch_optimizer") else ("adamw", "adamw (vs fused)", "muon")
    if tiny:
        result = optim.run(steps=2, warmup=1, threads=1, devices=("cpu",), matrix_shapes=[(64, 32), (32, 64)],
                           vector_shapes=[(32,)], names=names)
    else:
        result = optim.run(devices=("cuda",), names=names)
    if names is not None:
        result["note"] = "pytorch-optimizer is not installed: only the pairs with a torch reference ran"
    return {**result, "ok": True}


def _quality(budget_s: float, tiny: bool, record: Callable[[dict], None]) -> dict:
    from bubblefree.config import apply_overrides
    from bubblefree.data.tokens import load_tokens
    from bubblefree.experiments.scales import get_scale
    from bubblefree.optim import OPTIMIZERS
    from bubblefree.train import train

    start = time.perf_counter()
    scale = get_scale("smoke" if tiny else "gpu")
    base = apply_overrides(scale.base, {"train.device": "cpu" if tiny else "cuda", "train.eval_every": 0,
                                        "train.log_every": 2 if tiny else 10, "log.progress": False,
                                        "train.ckpt_every": 0, "train.ckpt_keep": 1, "optim.lr": 0.0})
    load_tokens(base.data)  # the tokenizer and token streams, built once (a fresh machine trains the BPE here)
    data_s = time.perf_counter() - start
    runs = [(opt, name, over) for opt in ("muon", "adamw")
            for name, over in (("sync", {"pipeline.schedule": "sync", "delay.correction": "none"}),
                               ("2bw", {"pipeline.schedule": "2bw", "delay.correction": "none"}),
                               ("2bw+ef", {"pipeline.schedule": "2bw", "delay.correction": "ef"}))]
    tokenizer = "byte" if base.data.tokenizer == "byte" else f"BPE {base.data.vocab_size}"
    out: dict[str, Any] = {"scale": scale.name, "model": base.model.preset, "tokenizer": tokenizer,
                           "batch_size": base.train.batch_size, "seq_len": base.train.seq_len,
                           "data_s": data_s, "runs": []}
    with tempfile.TemporaryDirectory(prefix="bubblefree-quality-") as work:
        def one(opt: str, name: str, over: dict, steps: int) -> tuple[dict, float]:
            config = apply_overrides(base, {**over, "optim.name": opt, "train.steps": steps})
            tic, run_dir = time.perf_counter(), Path(work) / f"{opt}-{name}-{steps}"
            summary = train(config, out_dir=run_dir)
            last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
            summary["last_window_tokens_per_s"] = last["tokens_per_s"]  # warmed up: no first-step start-up
            shutil.rmtree(run_dir)  # its final checkpoint: about 2 GB at 135M with Muon, EF ring and stash
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return summary, time.perf_counter() - tic

        # Calibration: the costliest of the six (2BW + EF keeps a stash and an EF ring) for a few steps.
        calib_steps = 4 if tiny else 30
        summary, wall = one("muon", "2bw+ef", runs[2][2], calib_steps)
        s_per_step = base.train.batch_size * base.train.seq_len / summary["last_window_tokens_per_s"]
        overhead = max(0.0, wall - calib_steps * s_per_step)  # model build, evaluation, final checkpoint
        left = budget_s - (time.perf_counter() - start) - 15.0  # the process's start-up and a margin
        steps = int((left / len(runs) - overhead) / s_per_step)
        steps = min(steps, 8 if tiny else scale.base.train.steps)
        out.update(calibration={"steps": calib_steps, "wall_s": wall, "s_per_step": s_per_step,
                                "overhead_s": overhead}, steps=steps,
                   tokens_per_run=steps * base.train.batch_size * base.train.seq_len)
        record(out)
        if steps < (2 if tiny else 20):  # fewer would be warmup only; the calibration above is still recorded
            raise RuntimeError(f"the budget leaves {steps} steps per run ({s_per_step:.3f} s per step, "
                               f"{overhead:.0f} s overhead per run)")
        for opt, name, over in runs:
            summary, wall = one(opt, name, over, steps)
            out["runs"].append({"optimizer": opt, "run": name, "steps": steps, "lr": OPTIMIZERS[opt].lr,
                                "final_val_loss": summary["final_val_loss"],
                                "tokens_per_s": summary["tokens_per_s"], "wall_s": wall})
            record(out)
    for opt in ("muon", "adamw"):
        loss = {r["run"]: r["final_val_loss"] for r in out["runs"] if r["optimizer"] == opt}
        gap = loss["2bw"] - loss["sync"]
        out.setdefault("gaps", {})[opt] = {"gap": gap, "ef_gap": loss["2bw+ef"] - loss["sync"],
                                           "recovered": (loss["2bw"] - loss["2bw+ef"]) / gap if gap else None}
    return {**out, "ok": True}


def _train(budget_s: float, tiny: bool, record: Callable[[dict], None]) -> dict:
    from bubblefree.bench.train import H100_BF16_PEAK_FLOPS, _compare, matmul_flops

    start = time.perf_counter()
    if tiny:
        device, preset, batch, seq_len, steps, warmup, backend = "cpu", "llama-1m", 2, 32, 2, 1, "eager"
        peak = matmul_flops(n=256, repeats=3)
    else:
        device, preset, batch, seq_len, steps, warmup, backend = "cuda", "smollm2-135m", 16, 2048, 6, 2, "inductor"
        peak = H100_BF16_PEAK_FLOPS
    matmul = matmul_flops(n=256 if tiny else 8192, repeats=3 if tiny else 7, device=device,
                          dtype=torch.bfloat16)
    out: dict[str, Any] = {"peak_flops": peak, "bf16_matmul_flops": matmul, "rows": []}
    record(out)
    for compile_backend in (None, backend):
        elapsed = time.perf_counter() - start
        if compile_backend is not None and budget_s - elapsed < (10.0 if tiny else 60.0):
            out["compile_skipped"] = f"{budget_s - elapsed:.0f} s left of the budget"
            break
        # Compiled per block (``train.compile``'s recipe: one graph serves every identical block): the whole
        # model under torch.compile took more than the part's 170 s to compile on an H200, ours and HF's.
        row = _compare(preset, batch=batch, seq_len=seq_len, steps=steps, warmup=warmup, device=device,
                       autocast=True, peak=peak, compile_backend=compile_backend,
                       per_block=compile_backend is not None)
        if compile_backend is not None:  # the row's compiled copies, under the eager row's names
            row = {**row, **{k.replace("_compiled", ""): v for k, v in row.items() if "_compiled_" in k},
                   "compile": f"torch.compile ({compile_backend}) per block"}
            row["ratio"] = row["ours_tokens_per_s"] / row["hf_tokens_per_s"]
        for name in ("ours", "hf"):
            row[f"{name}_mfu_vs_matmul"] = row[f"{name}_mfu"] * peak / matmul
        out["rows"].append(row)
        record(out)
        if device == "cuda":
            torch.cuda.empty_cache()
    return {**out, "ok": True}


_PART_FUNCTIONS: dict[str, Callable[[float, bool, Callable[[dict], None]], dict]] = {
    "checks": _checks, "memory": _memory, "optim": _optim, "quality": _quality, "train": _train}


# ------------------------------------------------------------------------------------- the orchestrator
def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _environment(tiny: bool) -> dict[str, Any]:
    env: dict[str, Any] = {"bubblefree": __version__, "commit": commit(), "python": platform.python_version(),
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(),
                           "host": platform.node(), "tiny": tiny}
    try:
        env["transformers"] = metadata.version("transformers")
    except Exception:  # noqa: BLE001 - recorded as missing; the train part will fail and say why
        env["transformers"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_bytes=props.total_memory,
                   capability=f"{props.major}.{props.minor}")
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _run_part(name: str, out: Path, budget_s: float, tiny: bool) -> dict:
    """Run one part in its own process group; kill it at its budget. Its partial results survive."""
    part_file, log_file = out / "parts" / f"{name}.json", out / "device.log"
    part_file.unlink(missing_ok=True)
    log_start = log_file.stat().st_size if log_file.is_file() else 0
    package_root = str(Path(__file__).resolve().parents[2])  # the child imports this same bubblefree
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                         if p)}
    cmd = [sys.executable, "-m", "bubblefree.bench.device", "--part", name, "--out", str(out),
           "--budget", f"{budget_s:.1f}"] + (["--tiny"] if tiny else [])
    tic = time.perf_counter()
    with log_file.open("a") as log:
        log.write(f"==== {name} (budget {budget_s:.0f} s) ====\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            code = None
            _kill_group(proc)
        except BaseException:  # SIGTERM or Ctrl-C of this process: the part's group must not outlive it
            _kill_group(proc)
            raise
    wall = time.perf_counter() - tic
    data = json.loads(part_file.read_text()) if part_file.is_file() else {}
    part_file.unlink(missing_ok=True)
    if part_file.parent.is_dir() and not any(part_file.parent.iterdir()):
        part_file.parent.rmdir()
    if code is None:
        status = "timeout"
    elif code != 0:
        status = "failed"
    else:
        status = "ok" if data.get("ok") else "failed"
    record = {"status": status, "wall_s": wall, "budget_s": budget_s, **data}
    if status != "ok":
        with log_file.open(errors="replace") as log:
            log.seek(log_start)
            tail = log.read().splitlines()[-25:]
        record["log_tail"] = "\n".join(tail)
    return record


def _child(name: str, out: Path, budget_s: float, tiny: bool) -> None:
    """The body of a part's process: run it, saving the partial results as they come."""
    part_file = out / "parts" / f"{name}.json"

    def record(data: dict) -> None:
        _write_json(part_file, {**data, "ok": False})  # not passed until the part returns

    if tiny:  # tiny tensors: a second thread buys nothing, and on a busy machine it waits for a core
        torch.set_num_threads(1)
    try:
        result = _PART_FUNCTIONS[name](budget_s, tiny, record)
    except BaseException as e:
        saved = json.loads(part_file.read_text()) if part_file.is_file() else {}
        _write_json(part_file, {**saved, "ok": False, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc()[-3000:]})
        raise
    _write_json(part_file, result)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run(out: Path | str | None = None, *, tiny: bool = False, parts: tuple[str, ...] = PARTS,
        budgets_s: dict[str, float] | None = None, deadline_s: float | None = None) -> dict:
    """Run the parts, writing ``device.json`` and ``device.md`` to ``out`` after each; return the record.

    Without ``tiny`` a CUDA device is required (a UserError otherwise). ``budgets_s`` overrides parts'
    budgets, ``deadline_s`` the whole command's (both in seconds)."""
    if not tiny and not torch.cuda.is_available():
        raise UserError(f"Invalid device check: no CUDA device is available (torch {torch.__version__}, "
                        f"built for CUDA {torch.version.cuda}); --tiny runs it on the CPU with tiny sizes")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise UserError(f"Invalid part: {unknown[0]!r} (expected one of {', '.join(PARTS)})")
    out = Path(out or f"runs/device-{time.strftime('%Y%m%d-%H%M%S')}")
    budgets = {**(TINY_BUDGETS_S if tiny else BUDGETS_S), **(budgets_s or {})}
    deadline = deadline_s if deadline_s is not None else (sum(TINY_BUDGETS_S.values()) if tiny else DEADLINE_S)
    command = "bubblefree bench device" + (" --tiny" if tiny else "") + f" --out {out}"
    result: dict[str, Any] = {"command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "deadline_s": deadline, "environment": _environment(tiny), "parts": {}}
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if threading.current_thread() is threading.main_thread():  # SIGTERM (a session's timeout) ends the run
        signal.signal(signal.SIGTERM, _terminate)               # cleanly: the running part is killed too
    for name in parts:
        left = deadline - (time.perf_counter() - start)
        budget = min(budgets[name], left)
        if budget < min(MIN_PART_S, budgets[name]):
            result["parts"][name] = {"status": "skipped", "budget_s": budgets[name],
                                     "note": f"{left:.0f} s left before the deadline"}
        else:
            print(f"bubblefree: device check: {name} (budget {budget:.0f} s) ...", flush=True)
            result["parts"][name] = _run_part(name, out, budget, tiny)
            print(f"bubblefree: device check: {name}: {result['parts'][name]['status']} in "
                  f"{result['parts'][name]['wall_s']:.0f} s", flush=True)
        result["wall_s"] = time.perf_counter() - start
        _write_json(out / "device.json", result)
        (out / "device.md").write_text(summary_markdown(result))
    passed = sum(p["status"] == "ok" for p in result["parts"].values())
    print(f"bubblefree: device check: {passed}/{len(parts)} parts passed in {result['wall_s']:.0f} s; "
          f"{out / 'device.json'}, {out / 'device.md'}", flush=True)
    return result


# ------------------------------------------------------------------------------------------- the summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=PARTS, help="run one part in this process (the orchestrator's child)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=None)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.part:
        _child(args.part, args.out, args.budget or BUDGETS_S[args.part], args.tiny)
    else:
        sys.exit(0 if all(p["status"] == "ok" for p in run(args.out, tiny=args.tiny)["parts"].values()) else 1)
