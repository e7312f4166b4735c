"""``device.md``: the accelerator check's results (``bench.device``'s ``device.json``) as the page a reader
takes in at a glance, each part's status, timings and figures."""

from __future__ import annotations

__all__ = ["summary_markdown"]


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def summary_markdown(result: dict) -> str:
    """The human-readable summary of a device check's record."""
    env, parts = result["environment"], result["parts"]
    lines = [f"# Device check: {env.get('gpu', 'CPU (--tiny)')}", "",
             f"`{result['command']}`, {result['started']}; torch {env['torch']} (CUDA {env['torch_cuda']}), "
             f"transformers {env['transformers']}, bubblefree {env['commit']}, {env['cpus']} CPUs. "
             f"Total {result.get('wall_s', 0):.0f} s against a deadline of {result['deadline_s']:.0f} s.", "",
             "| part | status | wall s | budget s |", "|---|---|---|---|"]
    for name, p in parts.items():
        lines.append(f"| {name} | {p['status']} | {p.get('wall_s', 0):.0f} | {p['budget_s']:.0f} |")
    for name, p in parts.items():
        if p.get("error") or p["status"] not in ("ok", "skipped") and p.get("log_tail"):
            lines += ["", f"**{name}**: {p.get('error') or p['status']}", "", "```",
                      p.get("log_tail", "")[-1500:], "```"]
    if parts.get("checks", {}).get("results"):
        lines += ["", "## Parity against a float64 CPU reference", "",
                  "| check | device | error | tolerance | ok |", "|---|---|---|---|---|"]
        for r in parts["checks"]["results"]:
            errs = r.get("errors", {})
            lines.append(f"| {r['check']} | {r['device']} | "
                         f"{', '.join(f'{k} {v:.2e}' for k, v in errs.items()) or r.get('error', '')} | "
                         f"{', '.join(f'{v:.0e}' for v in r.get('tolerances', {}).values())} | "
                         f"{'yes' if r['ok'] else '**no**'} |")
    if parts.get("memory", {}).get("rows"):
        m = parts["memory"]
        lines += ["", "## Activation memory: the plan against the device", "",
                  f"`{m['preset']}` at vocabulary {m['vocab_size']}, {m['batch']} x {m['seq_len']} tokens, one "
                  f"stage: `bubblefree plan`'s activations against what autograd saves on the device "
                  f"(tolerance {m.get('tolerance', 0.10):.0%}).", "",  # records from before the field: 10 % then
                  "| dtype | planned GiB | measured GiB | planned / measured | ok |", "|---|---|---|---|---|"]
        for r in m["rows"]:
            lines.append(f"| {r['dtype']} | {_gib(r['planned'])} | {_gib(r['measured'])} | {r['ratio']:.3f} | "
                         f"{'yes' if r['ok'] else '**no**'} |")
    if parts.get("train", {}).get("rows"):
        t = parts["train"]
        lines += ["", "## Training throughput: ours vs Hugging Face LlamaForCausalLM", "",
                  f"bf16 matmul (8192^3 on CUDA) measured {t['bf16_matmul_flops'] / 1e12:.3g} TFLOP/s; MFU "
                  f"against {t['peak_flops'] / 1e12:.3g} TFLOP/s (in brackets: against the measured matmul rate).",
                  "",
                  "| model | tokens/step | compile | ours tok/s | HF tok/s | ours/HF | MFU ours | MFU HF | "
                  "step peak GiB ours / HF | resident GiB | first step s ours / HF |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            lines.append(
                f"| {r['preset']} | {r['batch']} x {r['seq_len']} | {r['compile']} | {r['ours_tokens_per_s']:.0f} | "
                f"{r['hf_tokens_per_s']:.0f} | {r['ratio']:.3f} | "
                f"{r['ours_mfu']:.1%} ({r['ours_mfu_vs_matmul']:.1%}) | "
                f"{r['hf_mfu']:.1%} ({r['hf_mfu_vs_matmul']:.1%}) | {_gib(r.get('ours_step_peak_bytes'))} / "
                f"{_gib(r.get('hf_step_peak_bytes'))} | {_gib(r.get('resident_bytes'))} | "
                f"{r['ours_first_step_s']:.1f} / {r['hf_first_step_s']:.1f} |")
        if t.get("compile_skipped"):
            lines.append(f"\ntorch.compile skipped: {t['compile_skipped']}.")
    if parts.get("optim", {}).get("devices"):
        for device, rows in parts["optim"]["devices"].items():
            lines += ["", f"## Optimizer step time ({device}, median ms per step)", "",
                      "| optimizer | ours | reference | ours/ref | reference |", "|---|---|---|---|---|"]
            lines += [f"| {r['optimizer']} | {r['ours_ms']:.2f} | {r['ref_ms']:.2f} | {r['ratio']:.2f} | "
                      f"{r['reference']} |" for r in rows]
    q = parts.get("quality", {})
    if q.get("runs") or q.get("calibration"):
        c = q.get("calibration", {})
        lines += ["", f"## Quality: sync vs 2BW vs 2BW + EF at {q['model']} shapes", "",
                  f"Scale `{q['scale']}`'s run ({q['tokenizer']}, {q['batch_size']} x {q['seq_len']} "
                  f"tokens per step), one seed, registry learning rates, {q.get('steps', '?')} steps "
                  f"({q.get('tokens_per_run', 0) / 1e6:.1f}M tokens) per run; calibration "
                  f"{c.get('s_per_step', float('nan')):.3f} s per step, {c.get('overhead_s', float('nan')):.0f} s "
                  f"per run besides the steps; tokenizer and data {q.get('data_s', float('nan')):.0f} s.", "",
                  "| optimizer | run | final val loss | tokens/s | wall s |", "|---|---|---|---|---|"]
        lines += [f"| {r['optimizer']} | {r['run']} | {r['final_val_loss']:.4f} | {r['tokens_per_s']:.0f} | "
                  f"{r['wall_s']:.0f} |" for r in q.get("runs", [])]
        for opt, g in q.get("gaps", {}).items():
            rec = "-" if g["recovered"] is None else f"{g['recovered']:.0%}"
            lines.append(f"\n{opt}: gap 2BW - sync {g['gap']:+.4f}, 2BW + EF - sync {g['ef_gap']:+.4f}, "
                         f"recovered by EF {rec}.")
    return "\n".join(lines) + "\n"
