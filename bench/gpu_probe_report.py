"""The GPU probe's report (bench/gpu_probe.py): the parts' rows summarised, the goals' verdicts, and the
Markdown page of bench/results/<gpu>-<date>.md.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from roofline import MFU_GOAL, _num, _pct

from zrl.modeling.kernels import AUTO_ON_CUDA

GEMM_GOAL = 0.70
# The fp32-level LM head does 12 bf16 GEMM-equivalents forward + backward where transformers' bf16 head
# does 3: at equal GEMM efficiency it runs at 1/4 of that head's speed.
LM_HEAD_GOAL = 0.25


@dataclasses.dataclass
class PartResult:
    name: str
    arg: str
    status: str  # ok | failed (exit status n) | timed out after n s | skipped: ...
    seconds: float
    rows: list[dict]
    log_tail: str = ""


def summarise(parts: list[PartResult]) -> dict:
    """Everything the report shows, from the parts' rows: env, trainer runs, kernel rows, tests, errors."""
    out = dict(env={}, gemm=None, kernels=[], dense={}, trainer={}, gpu_tests=None, errors=[], notes=[])
    for part in parts:
        label = f"{part.name} {part.arg}".strip()
        for full_row in part.rows:
            kind, row = full_row["kind"], {k: v for k, v in full_row.items() if k != "kind"}
            if kind == "env":
                out["env"] = row
            elif kind == "gemm":
                out["gemm"] = row
            elif kind == "kernel":
                out["kernels"].append(row)
            elif kind == "dense_gemm":
                out["dense"][row["tokens"]] = row
            elif kind == "trainer_step":
                out["trainer"].setdefault(part.arg, {"steps": []})["steps"].append(row)
            elif kind in ("trainer_setup", "profile"):
                out["trainer"].setdefault(part.arg, {"steps": []})[kind] = row
            elif kind == "gpu_tests":
                out["gpu_tests"] = row
            elif kind == "error":
                out["errors"].append(f"{label}: {row['where']}: {row['error']}")
            else:
                out["notes"].append(f"{label}: {row.get('text', row)}")
    gemm = out["gemm"]["tflops"] * 1e12 if out["gemm"] else math.nan
    for run in out["trainer"].values():
        timed = [s for s in run["steps"] if not s["warmup"]]
        warmup_only = not timed
        timed = timed or run["steps"]  # a part that ran out of time after its warm-up: that step, marked
        if timed:
            step_s = statistics.median(s["step_s"] for s in timed)
            flops = statistics.median(s["model_flops"] / s["step_s"] for s in timed)
            run["summary"] = dict(
                steps=len(timed), warmup_only=warmup_only, step_s=step_s,
                tokens=statistics.median(s["tokens"] for s in timed),
                tokens_per_s=statistics.median(s["tokens"] / s["step_s"] for s in timed), tflops=flops / 1e12,
                mfu=flops / gemm, optimizer_share=statistics.median(s["optimizer_s"] / s["step_s"] for s in timed),
                peak_gib=max(s["peak_memory_gib"] for s in run["steps"]), warmup_s=run["steps"][0]["step_s"])
    return out


def kernel_row(s: dict, tokens: int, group: str, impl: str, mode: str) -> dict | None:
    key = (tokens, group, impl, mode)
    return next((r for r in s["kernels"] if (r["tokens"], r["group"], r["impl"], r["mode"]) == key), None)


def goals(s: dict, kernel_tokens: tuple[int, int]) -> list[tuple[str, str, str, str]]:
    """(goal, measured, target, verdict) rows of the summary."""
    def ratio(group: str, base: str, impl: str, mode: str, tokens: int) -> float:
        a, b = kernel_row(s, tokens, group, base, mode), kernel_row(s, tokens, group, impl, mode)
        return a["ms"] / b["ms"] if a and b else math.nan

    def verdict(ok: bool | None) -> str:
        return "-" if ok is None else ("met" if ok else "NOT met")

    small, large = kernel_tokens
    rows = []
    run = s["trainer"].get("4", {}).get("summary")
    mfu = run["mfu"] if run else math.nan
    measured = _pct(mfu) + (f" ({run['tflops']:.0f} TFLOP/s{', warm-up step only' if run['warmup_only'] else ''})"
                            if run else "")
    rows.append(("MFU fwd+bwd, 4 layers x ~64k tokens", measured, f">= {MFU_GOAL:.0%}",
                 verdict(None if math.isnan(mfu) else mfu >= MFU_GOAL)))
    head = AUTO_ON_CUDA["lm_logprobs"]  # what the trainer runs; its fp32-level accuracy costs ~4x a bf16 head
    for mode in ("fwd", "fwd+bwd"):
        r = ratio("lm_logprobs", "transformers", head, mode, small)
        rows.append((f"LM head {mode} at {small}: transformers (bf16) ms / {head} ms", _num(r, ".2f") + "x",
                     f">= {LM_HEAD_GOAL}x", verdict(None if math.isnan(r) else r >= LM_HEAD_GOAL)))
    for tokens in (small, large):
        shares = {impl: kernel_row(s, tokens, "experts", impl, "fwd") for impl in ("triton", "grouped_mm")}
        text = ", ".join(f"{impl} {_pct(r['share_gemm'] if r else math.nan)}" for impl, r in shares.items())
        best = max((r["share_gemm"] for r in shares.values() if r), default=math.nan)
        rows.append((f"experts fwd share of the dense GEMM at {tokens}", text, f">= {GEMM_GOAL:.0%}",
                     verdict(None if math.isnan(best) else best >= GEMM_GOAL)))
    for group in ("cca", "layer"):
        r = ratio(group, "reference", "triton", "fwd+bwd", small)
        rows.append((f"{group} fwd+bwd at {small}: reference ms / triton ms", _num(r, ".2f") + "x", "> 1x",
                     verdict(None if math.isnan(r) else r > 1.0)))
    t = s["gpu_tests"]
    if t and "tests" in t:
        bad = t["failures"] + t["errors"]
        rows.append(("`gpu` tests", f"{t['passed']} passed, {bad} failed, {t['skipped']} skipped", "all pass",
                     verdict(None if t["passed"] + bad == 0 else bad == 0)))
    else:
        rows.append(("`gpu` tests", (t or {}).get("error", "not run"), "all pass", "-"))
    return rows


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n:,.0f}"


def render(s: dict, parts: list[PartResult], meta: dict) -> str:
    env, dev = s["env"], s["env"].get("device", {})
    v, gemm = env.get("versions", {}), s["gemm"]
    hardware = f"{dev['memory_gib']:.0f} GiB, {dev['sms']} SMs, sm {dev['capability']}; " if dev.get("sms") else ""
    lines = [f"# GPU probe: {dev.get('name', 'unknown device')}, {meta['date']}", ""]
    if meta["smoke"]:
        lines += ["**Smoke run (tiny shapes on CPU): it checks the probe runs; no rate here is a claim.**", ""]
    lines += [f"torch {env.get('torch')} (CUDA {env.get('cuda')}), Triton {v.get('triton')}, transformers "
              f"{v.get('transformers')}, Python {env.get('python')}; commit {meta['commit']}; {hardware}"
              f"kernels auto on CUDA: {env.get('auto_on_cuda') or 'not recorded'}.",
              f"Dense GEMM {gemm['n']}^3 {gemm['dtype']}: **{gemm['tflops']:.1f} TFLOP/s** (the MFU denominator)."
              if gemm else "Dense GEMM: not measured.",
              f"Command: `{meta['command']}`; {meta['wall_s']:.0f} s wall of a {meta['budget_s']:.0f} s budget.", "",
              "## Summary", "", "| goal | measured | target | |", "|---|---|---|---|"]
    lines += [f"| {g} | {m} | {t} | {v_} |" for g, m, t, v_ in goals(s, meta["kernel_tokens"])]
    lines += ["", "## Parts", "", "| part | status | s |", "|---|---|---|"]
    lines += [f"| {p.name} {p.arg} | {p.status} | {p.seconds:.0f} |" for p in parts]
    for layers, run in s["trainer"].items():
        lines += render_trainer(layers, run, gemm["tflops"] * 1e12 if gemm else math.nan)
    for tokens in sorted({r["tokens"] for r in s["kernels"]}):
        lines += render_kernels(s, tokens)
    t = s["gpu_tests"]
    lines += ["", "## `pytest -m gpu zrl/modeling/kernels zrl/moepp/kernels`", ""]
    if t and "tests" in t:
        lines.append(f"{t['passed']} passed, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped.")
        for f in t["failed"]:
            lines.append(f"- `{f['test']}`: {f['first_line']}")
            if f.get("detail"):
                lines += ["  ```", *(f"  {line}" for line in f["detail"].splitlines()), "  ```"]
    else:
        lines.append((t or {}).get("error", "not run"))
    problems = s["errors"] + s["notes"] + [f"{p.name} {p.arg}: {p.status}\n```\n{p.log_tail}\n```"
                                           for p in parts if p.log_tail]
    lines += ["", "## Errors, time-outs and notes", ""] + ([f"- {e}" for e in problems] or ["None."])
    return "\n".join(lines) + "\n"


def render_trainer(layers: str, run: dict, gemm: float) -> list[str]:
    setup, summ, prof = run.get("trainer_setup"), run.get("summary"), run.get("profile")
    lines = ["", f"## Trainer: {layers} layers", ""]
    if setup:
        lines.append(f"{_count(setup['params'])} parameters ({setup['shape']}), {setup['dtype']} parameters, kernels "
                     f"{setup['kernels']}, activation checkpointing {setup['checkpointing']}; checkpoint built in "
                     f"{setup['build_s']:.0f} s, TrainerWorker up in {setup['load_s']:.0f} s.")
    if summ:
        which = "the warm-up step only (compilation included)" if summ["warmup_only"] else \
            f"median of {summ['steps']} steps after the warm-up"
        lines += ["", f"{which.capitalize()}: **{summ['tokens_per_s']:,.0f} tokens/s**, {summ['step_s']:.3f} s per "
                  f"step of {summ['tokens']:,.0f} tokens, {summ['tflops']:.1f} TFLOP/s = **MFU {_pct(summ['mfu'])}**, "
                  f"optimizer {_pct(summ['optimizer_share'])} of the step, peak {summ['peak_gib']:.1f} GiB; "
                  f"warm-up step {summ['warmup_s']:.2f} s."]
    lines += ["", "| step | tokens | docs | step s | fwd s | bwd s | optim s | tokens/s | model TFLOP | MFU | "
              "peak GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for st in run["steps"]:
        lines.append(f"| {st['step']}{' (warm-up)' if st['warmup'] else ''} | {st['tokens']:,} | {st['docs']} | "
                     f"{st['step_s']:.3f} | {st['forward_s']:.3f} | {st['backward_s']:.3f} | {st['optimizer_s']:.3f} "
                     f"| {st['tokens'] / st['step_s']:,.0f} | {st['model_flops'] / 1e12:.2f} | "
                     f"{_pct(st['model_flops'] / st['step_s'] / gemm)} | {st['peak_memory_gib']:.1f} |")
    if prof:
        cpu_only = prof["timed"] == "self CPU"  # then the two time columns would be the same
        lines += ["", f"One step under torch.profiler ({prof['step_s']:.3f} s with the profiler on; {prof['timed']} "
                  f"time summed over all ops {prof['busy_s']:.3f} s = {_pct(prof['busy_s'] / prof['step_s'])} of the "
                  f"step), top {len(prof['top'])} by {prof['timed']} time:", "",
                  f"| op | calls | {prof['timed']} ms |{'' if cpu_only else ' self CPU ms |'}",
                  "|---|---|---|" + ("" if cpu_only else "---|")]
        lines += [f"| `{r['name'].replace('|', '/')}` | {r['calls']} | {r['self_ms']:.2f} |"
                  + ("" if cpu_only else f" {r['self_cpu_ms']:.2f} |") for r in prof["top"]]
    return lines


def render_kernels(s: dict, tokens: int) -> list[str]:
    dense = s["dense"].get(tokens, {})
    lines = ["", f"## Kernels at T = {tokens}", "",
             f"Dense [T, D] x [D, 2F] GEMM in the same part: {dense.get('tflops', math.nan):.1f} TFLOP/s (the 'GEMM "
             f"share' column); shape {dense.get('shape')}, mean document length {dense.get('doc_len')}. 'vs ref' and "
             "'vs HF': the reference's and transformers' time / this row's (> 1 = faster); '~': one call only, "
             "compilation included.", "",
             "| op | impl | mode | ms | vs ref | vs HF | TFLOP/s | GEMM share | GB/s | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in [r for r in s["kernels"] if r["tokens"] == tokens]:
        base = "reference+proj" if r["group"] == "cca+proj" else "reference"
        ref, hf = (kernel_row(s, tokens, r["group"], name, r["mode"]) for name in (base, "transformers"))
        lines.append(f"| {r['group']} | {r['impl']} | {r['mode']} | {'~' if r['calls'] == 0 else ''}{r['ms']:.3f} | "
                     f"{_num(ref['ms'] / r['ms'] if ref else math.nan, '.2f')} | "
                     f"{_num(hf['ms'] / r['ms'] if hf else math.nan, '.2f')} | {_num(r['tflops'], '.1f')} | "
                     f"{_pct(r['share_gemm'])} | {_num(r['gbs'], '.0f')} | {r['note'] if r['mode'] == 'fwd' else ''} |")
    return lines
