"""Measured pipeline throughput of the real runtime against the schedule simulator (docs/throughput.md).

``bubblefree bench pipeline`` runs, side by side in one run and on the same stages, torch.distributed.pipelining's
``ScheduleGPipe`` and ``Schedule1F1B`` (the runtime's ``gpipe`` and ``1f1b``) and our persistent PipeDream-2BW
loop (``2bw``), all through :class:`~bubblefree.distributed.DistributedExecutor`:

* fixed-cost synthetic stages (:mod:`bubblefree.bench.synthetic`: each forward sleeps ``t_F``, each
  backward ``t_B``) at ``P = 4`` and ``8`` for ``M`` in ``{P, 2P, 4P}``; sleeping frees the CPU, so 8 ranks
  fit on 2 cores and what is measured is the runtime's schedule, not the machine's arithmetic;
* the real transformer (the ``smoke`` preset with :data:`REAL_OVERRIDES`) at ``P = 2``, in tokens per second.

Per run, the *step time* is the mean spacing of stage 0's optimizer updates over the steady window
``[end of step 0, end of step T-2]``: the first step (process-group warm-up, the stock schedules' shape
inference, 2BW's single fill) and the last (2BW's single drain) are left out. Ideally a flushing 1F1B
step is ``(M+P-1)(t_F+t_B)`` and a 2BW step ``M(t_F+t_B)``, so 2BW's throughput is ``(M+P-1)/M`` times
1F1B's (Narayanan et al. 2021, PipeDream-2BW; arXiv 2606.30634 section 2). The simulator
(:func:`bubblefree.schedules.timeline.simulate`) predicts the same window from the same costs. Per stage,
the peak activations in flight (a forward begun whose backward has not ended) are counted from the traces
(``trace/rank<r>.jsonl``), and the weight versions alive at once are counted on the stage itself (the live
weights and every version a step in flight computes on, told apart by value) and set beside the
simulator's ``peak_activations()`` and ``weight_versions()``.

    bubblefree bench pipeline --out DIR      # bench_pipeline.json, pipeline_P<P>.png, run folders
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bubblefree.bench.synthetic import SyntheticModel, synthetic_data
from bubblefree.config import Config
from bubblefree.data import load_tokens
from bubblefree.distributed import DistributedExecutor, init_mesh
from bubblefree.models import build_model
from bubblefree.optim.schedule import lr_scale
from bubblefree.schedules import get_schedule
from bubblefree.schedules.ir import build_schedule
from bubblefree.schedules.render import Panel, Span, draw_panels, timeline_panel
from bubblefree.schedules.table import Runtime
from bubblefree.schedules.timeline import Costs, simulate
from bubblefree.train.presets import load_config

__all__ = ["BASELINE", "DRAWN", "REAL_OVERRIDES", "SCHEDULES", "peak_in_flight", "read_traces", "run", "run_cases",
           "synthetic_config", "trace_panel"]

SCHEDULES = ("gpipe", "1f1b", "2bw")
"""The runtime's names; the simulator's are the same."""

BASELINE = "1f1b"
"""The flushing schedule each asynchronous one's throughput is set beside, at the same ``P`` and ``M``."""

DRAWN = ("1f1b", "2bw")
"""The schedules whose measured and simulated timelines the pictures show."""

REAL_OVERRIDES = ("model.preset=llama-5m", "train.seq_len=128", "train.batch_size=32")
"""The real runs: the ``smoke`` preset with a model and batch large enough for forwards and backwards to
dominate a step. The optimizer update is the part no schedule hides, and it is a fixed cost per step, so a
larger batch makes its share smaller; with ``llama-1m`` at 64 tokens, data, transfers and Python would fill
most of a rank's time (docs/throughput.md has the measurements)."""


# ------------------------------------------------------------------------------------------- running
def synthetic_config(schedule: str, stages: int, microbatches: int, *, steps: int) -> Config:
    """A run of synthetic stages: one sequence of 4 tokens per microbatch, AdamW, no delay correction."""
    c = Config()
    c.pipeline.schedule, c.pipeline.stages, c.pipeline.microbatches = schedule, stages, microbatches
    c.pipeline.runtime = "distributed"
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.device = steps, microbatches, 4, "cpu"
    c.optim.name, c.optim.lr = "adamw", 1e-2
    c.delay.correction, c.delay.sync_start_steps, c.delay.sync_cooldown_steps = "none", 0, 0
    return c


def _versions_counter(stage) -> list[int]:
    """Count, after every ``enter`` and ``update`` of ``stage``, the distinct weight versions it holds: the
    live weights and the copy each entered step computes on (equal values are one version). Returns a
    one-element list holding the peak (1 for the stock schedules, which run on the live weights only)."""
    peak = [1]

    def count() -> None:
        held = [[p.detach() for p in stage.params]] + [list(v.values()) for v in stage._versions.values()]
        distinct: list[list[torch.Tensor]] = []
        for tensors in held:
            if not any(all(torch.equal(a, b) for a, b in zip(tensors, d)) for d in distinct):
                distinct.append(tensors)
        peak[0] = max(peak[0], len(distinct))

    def wrap(fn):
        def counted(*args, **kwargs):
            result = fn(*args, **kwargs)
            count()
            return result
        return counted

    stage.enter, stage.update = wrap(stage.enter), wrap(stage.update)
    return peak


def _build(case: dict, stage: int):
    """``(model, data, stage_module)`` of a case: synthetic stages, or the preset's model and corpus."""
    config: Config = case["config"]
    if case.get("synthetic"):
        t_f, t_b = case["synthetic"]
        model = SyntheticModel(config.pipeline.stages, t_forward=t_f, t_backward=t_b)
        return model, synthetic_data(model.vocab), model.stage(stage)
    torch.manual_seed(config.train.seed)
    data = load_tokens(config.data)
    return build_model(config.model.preset, vocab_size=config.model.vocab_size or data.vocab_size), data, None


def _worker(index: int, nprocs: int, port: int, cases: list[dict]) -> None:
    """One rank: every case in turn on one process group; writes ``<case dir>/rank<r>.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), LOCAL_RANK=str(index),
                      WORLD_SIZE=str(nprocs))
    torch.set_num_threads(1)  # one per rank: several ranks share 2 cores
    mesh = init_mesh(stages=nprocs, timeout_s=120)
    for case in cases:
        config, out = case["config"], Path(case["dir"])
        model, data, stage_module = _build(case, mesh.stage)
        executor = DistributedExecutor(config, model, data, out_dir=out, mesh=mesh, timeout_s=120,
                                       stage_module=stage_module)
        versions = _versions_counter(executor.stage) if case.get("synthetic") else [None]
        cfg, train_s, evals = config.train, 0.0, []
        for step in range(cfg.steps):
            scale = lr_scale(step, cfg.steps, warmup_frac=cfg.warmup_frac, min_lr_frac=cfg.min_lr_frac) \
                if case.get("lr_schedule") else 1.0
            tic = time.perf_counter()
            executor.train_step(step, scale)
            train_s += time.perf_counter() - tic
            if case.get("eval_every") and ((step + 1) % case["eval_every"] == 0 or step + 1 == cfg.steps):
                evals.append({"step": step + 1, "train_s": train_s, "val_loss": executor.evaluate()})
        executor.close()
        (out / f"rank{mesh.rank}.json").write_text(json.dumps({"weight_versions": versions[0], "evals": evals,
                                                               "train_s": train_s}))
        dist.barrier()
    dist.destroy_process_group()  # an exit with gloo's threads still running can abort the process


def run_cases(cases: list[dict], nprocs: int) -> None:
    """Run ``cases`` (dicts: ``config``, ``dir``, optional ``synthetic=(t_F, t_B)``, ``eval_every``,
    ``lr_schedule``) one after another in one set of ``nprocs`` local processes (one per stage)."""
    for case in cases:
        if case["config"].pipeline.stages != nprocs:
            raise ValueError(f"Invalid case {case['dir']}: {case['config'].pipeline.stages} stages, not {nprocs}")
        Path(case["dir"]).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(nprocs, port, cases), nprocs=nprocs, start_method="spawn")


# ------------------------------------------------------------------------------------------ analysis
def read_traces(run_dir: Path) -> list[dict]:
    """Every record of ``run_dir/trace/rank*.jsonl`` (see :mod:`bubblefree.distributed.trace`)."""
    return [json.loads(line) for path in sorted((Path(run_dir) / "trace").glob("rank*.jsonl"))
            for line in path.read_text().splitlines()]


def _microbatch(record: dict, schedule: str, m: int) -> int:
    # The async loop numbers units over the run; the stock schedules number chunks within the step.
    return record["unit"] if get_schedule(schedule).runtime is Runtime.ASYNC else record["step"] * m + record["unit"]


def peak_in_flight(records: list[dict], n_stages: int, schedule: str, m: int) -> list[int]:
    """Per stage, the most microbatches whose forward has started and whose backward has not ended."""
    peaks = []
    for stage in range(n_stages):
        events = []
        for r in records:
            if r["stage"] == stage and r["kind"] in "FB":
                events.append((r["start"], 1) if r["kind"] == "F" else (r["end"], -1))
        level = peak = 0
        for _, delta in sorted(events):
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return peaks


def _update_ends(records: list[dict]) -> list[float]:
    """End time of stage 0's update of each step (the replica-0 rank-0 trace), by step."""
    ends = {r["step"]: r["end"] for r in records if r["rank"] == 0 and r["kind"] == "U"}
    return [ends[t] for t in sorted(ends)]


def trace_panel(records: list[dict], *, title: str, n_stages: int, schedule: str, m: int) -> Panel:
    """The measured forwards and backwards as a panel (seconds from the first forward)."""
    work = [r for r in records if r["kind"] in "FB"]
    t0 = min(r["start"] for r in work)
    spans = tuple(Span(r["stage"], r["kind"], _microbatch(r, schedule, m), r["start"] - t0, r["end"] - t0)
                  for r in work)
    return Panel(title, n_stages, spans, xlabel="seconds")


def _analyse(case: dict, steps: int) -> dict:
    config, run_dir = case["config"], Path(case["dir"])
    P, M, name = config.pipeline.stages, config.pipeline.microbatches, config.pipeline.schedule
    records = read_traces(run_dir)
    ends = _update_ends(records)
    assert len(ends) == steps, (run_dir, len(ends))
    step_s = (ends[steps - 2] - ends[0]) / (steps - 2)
    row: dict[str, Any] = {"schedule": name, "P": P, "M": M, "steps": steps, "step_s": step_s,
                           "microbatches_per_s": M / step_s,
                           "tokens_per_s": config.train.batch_size * config.train.seq_len / step_s,
                           "peak_activations": peak_in_flight(records, P, name, M)}
    if case.get("synthetic"):
        t_f, t_b = case["synthetic"]
        costs = Costs(forward=t_f, backward=t_b, weight=0.0)
    else:  # the real stages' own costs: mean forward, backward and update over the steady window
        costs = Costs(**{field: statistics.mean(r["end"] - r["start"] for r in records
                                                if r["kind"] == kind and 0 < r["step"] < steps - 1)
                         for field, kind in (("forward", "F"), ("backward", "B"), ("update", "U"))}, weight=0.0)
        row["measured_costs"] = {"forward": costs.forward, "backward": costs.backward, "update": costs.update}
    tl = simulate(build_schedule(name, P, M, steps=steps), costs)
    row["predicted_step_s"] = (tl.updates[(0, steps - 2)] - tl.updates[(0, 0)]) / (steps - 2)
    row["prediction_error"] = abs(row["predicted_step_s"] - step_s) / step_s
    row["sim_peak_activations"] = tl.peak_activations()
    if case.get("synthetic"):
        row["sim_weight_versions"] = tl.weight_versions()
        row["weight_versions"] = [json.loads((run_dir / f"rank{r}.json").read_text())["weight_versions"]
                                  for r in range(P)]
        case["timeline"] = tl
    case["records"] = records
    return row


def _add_ratios(rows: list[dict]) -> None:
    """An asynchronous schedule's (2BW's) throughput over the :data:`BASELINE`'s at the same (P, M), beside the
    ideal (M+P-1)/M."""
    by_key = {(r["P"], r["M"], r["schedule"]): r for r in rows}
    for r in rows:
        base = by_key.get((r["P"], r["M"], BASELINE))
        if get_schedule(r["schedule"]).runtime is Runtime.ASYNC and base is not None:
            r["vs_1f1b"] = base["step_s"] / r["step_s"]
            r["ideal_vs_1f1b"] = (r["M"] + r["P"] - 1) / r["M"]
            r["of_ideal"] = r["vs_1f1b"] / r["ideal_vs_1f1b"]
            # The simulator's ratio at the measured costs: below the ideal by the update no schedule hides.
            r["sim_vs_1f1b"] = base["predicted_step_s"] / r["predicted_step_s"]


def _fmt(values: list[int] | None) -> str:
    return "-" if values is None else ",".join(map(str, values))


def print_table(rows: list[dict]) -> None:
    print(f"{'kind':<15}{'sched':<7}{'P':>3}{'M':>4}{'step s':>9}{'pred s':>9}{'err':>7}{'mb/s':>8}{'tok/s':>9}"
          f"{'2bw/1f1b':>9}{'ideal':>7}{'of ideal':>9}{'sim':>7}  {'activations (sim)':<36}{'versions (sim)':<36}")
    for r in rows:
        pred = f"{r['predicted_step_s']:>9.3f}{r['prediction_error']:>7.1%}" if "predicted_step_s" in r else \
            f"{'-':>9}{'-':>7}"
        ratio = f"{r['vs_1f1b']:>9.3f}{r['ideal_vs_1f1b']:>7.3f}{r['of_ideal']:>9.3f}{r['sim_vs_1f1b']:>7.3f}" \
            if "vs_1f1b" in r else f"{'':>9}{'':>7}{'':>9}{'':>7}"
        act = f"{_fmt(r['peak_activations'])} ({_fmt(r.get('sim_peak_activations'))})"
        ver = f"{_fmt(r.get('weight_versions'))} ({_fmt(r.get('sim_weight_versions'))})"
        print(f"{r['kind']:<15}{r['schedule']:<7}{r['P']:>3}{r['M']:>4}{r['step_s']:>9.3f}{pred}"
              f"{r['microbatches_per_s']:>8.1f}{r['tokens_per_s']:>9.0f}{ratio}  {act:<36}{ver:<36}")


def run(out: Path | None = None, *, stages: tuple[int, ...] = (4, 8), multiples: tuple[int, ...] = (1, 2, 4),
        t_forward: float = 0.04, t_backward: float = 0.08, steps: int = 5, real: bool = True,
        real_microbatches: int = 4, real_steps: int = 20,
        real_overrides: tuple[str, ...] = REAL_OVERRIDES, schedules: tuple[str, ...] = SCHEDULES) -> dict:
    """Measure (module docstring), print the table, write ``bench_pipeline.json`` and one PNG per ``P``
    (measured 1F1B and 2BW timelines beside the simulator's, at the middle of ``multiples``: ``M = 2P`` by
    default) to ``out`` (a temporary folder if None). ``real_overrides`` (``section.key=value``) change the
    real run's ``smoke`` configuration, e.g. a larger ``model.preset``."""
    if steps < 3 or real_steps < 3:
        raise ValueError(f"Invalid steps: {min(steps, real_steps)} (the steady window needs at least 3 steps)")
    root = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="bench_pipeline-"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows, pictures = [], []
    groups: list[tuple[int, list[dict]]] = []
    for P in stages:
        groups.append((P, [{"config": synthetic_config(s, P, k * P, steps=steps), "synthetic": (t_forward, t_backward),
                            "dir": str(root / "runs" / stamp / f"synthetic-P{P}-M{k * P}-{s}")}
                           for k in multiples for s in schedules]))
    if real:
        base = load_config("smoke", None, ["pipeline.stages=2", f"pipeline.microbatches={real_microbatches}",
                                           f"train.steps={real_steps}", "pipeline.runtime=distributed",
                                           *real_overrides])
        groups.append((2, [{"config": replace(base, pipeline=replace(base.pipeline, schedule=s)),
                            "dir": str(root / "runs" / stamp / f"real-P2-M{real_microbatches}-{s}")}
                           for s in schedules]))
    load, drawn = os.getloadavg()[0], multiples[len(multiples) // 2]
    for P, cases in groups:
        tic = time.perf_counter()
        run_cases(cases, P)
        print(f"P={P}: {len(cases)} runs in {time.perf_counter() - tic:.0f} s")
        for case in cases:
            row = _analyse(case, case["config"].train.steps)
            row["kind"] = "synthetic" if case.get("synthetic") else f"real {case['config'].model.preset}"
            rows.append(row)
        shown = [c for c in cases if c.get("synthetic") and c["config"].pipeline.microbatches == drawn * P
                 and c["config"].pipeline.schedule in DRAWN]
        if shown and out is not None:
            panels = []
            for c in shown:
                pipe = c["config"].pipeline
                title = f"measured {pipe.schedule}: P={P}, M={pipe.microbatches}, F {t_forward:g} s, B {t_backward:g} s"
                panels.append(trace_panel(c["records"], title=title, n_stages=P, schedule=pipe.schedule,
                                          m=pipe.microbatches))
                sim = timeline_panel(c["timeline"])
                panels.append(replace(sim, title=f"simulated {sim.title}", xlabel="seconds"))
            pictures.append(draw_panels(panels, root / f"pipeline_P{P}.png", dpi=80).name)  # beside the JSON
    _add_ratios(rows)
    print_table(rows)
    result = {"command": "bubblefree bench pipeline", "t_forward": t_forward, "t_backward": t_backward,
              "load_before": load, "load_after": os.getloadavg()[0], "cpus": os.cpu_count(), "rows": rows,
              "pictures": pictures, "median_prediction_error": statistics.median(
                  [r["prediction_error"] for r in rows if "prediction_error" in r] or [float("nan")])}
    print(f"load average {load:.1f} before, {result['load_after']:.1f} after, on {os.cpu_count()} cpus; "
          f"median |pred - meas| / meas = {result['median_prediction_error']:.1%}")
    if out is not None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "bench_pipeline.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {root / 'bench_pipeline.json'}" + (f", {', '.join(str(root / p) for p in pictures)}"
                                                          if pictures else ""))
    return result
