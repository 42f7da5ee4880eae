"""The GPU session's report (bench/gpu_session.py) as Markdown, ending with the changes its numbers justify as one
diff ready to apply: the attention table's row for the GPU, the measured throughput rows, the compile mode and runs
per GPU that finish the paper's grid soonest (as new defaults) and docs/grid.md's wall time. Standard library only,
like the driver.
"""
from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

from bench import throughput

COMPILE_DEFAULT = (Path("train_gpt.py"), re.compile(r'(compile_mode: str = uncompared\(\s*")([\w-]+)(")'))
RUNS_PER_GPU_DEFAULT = (Path("grid/__main__.py"), re.compile(r'("--runs-per-gpu", type=int, default=)(\d+)()'))
STEP_TARGET, SHARING_TARGET = 1.3, 1.5  # paper-batch step / its device time; best runs-per-GPU / one run
E2E_MODES = {"e2e_kernels": "default", "e2e_graph": "reduce-overhead"}  # the session's one-run steps: compile mode


def _num(value: object, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "n/a"


def captured(result: dict | None) -> bool:
    """Whether an e2e run's step was replayed from a CUDA graph (its log said so)."""
    return bool(result) and any(line.startswith("CUDA graph: the training step is captured")
                                for line in result.get("graph") or [])


def faster_mode(e2e: dict) -> str:
    """The compile mode whose paper-batch run had more tokens/s (reduce-overhead only if its step was captured)."""
    default, graph = e2e.get("e2e_kernels"), e2e.get("e2e_graph")
    if captured(graph) and (not isinstance(default, dict) or graph["tokens_per_s"] > default["tokens_per_s"]):
        return "reduce-overhead"
    return "default"


def throughput_rows(report: dict) -> list[dict]:
    """bench/throughput.json's rows from this session: one run alone in each compile mode measured, and the
    concurrent runs."""
    env, e2e, rows = report["env"] or {}, report["e2e"], []
    source = (f"bash bench/gpu_session.sh {report['date'][:10]}, commit {report['commit']}, torch "
              f"{env.get('torch', '?')}")

    def row(mode: str, n: int, tokens_per_s: float) -> dict:
        return {"gpu": env.get("gpu", "?"), "preset": "gpt2-124m", "optimizer": "adamw", "batch_tokens": 4096,
                "compile_mode": mode, "runs_per_gpu": n, "tokens_per_s": round(tokens_per_s),
                "step_ms": round(1e3 * 4096 * n / tokens_per_s, 3), "source": source}

    for name, mode in E2E_MODES.items():
        result = e2e.get(name)
        if isinstance(result, dict) and (mode == "default" or captured(result)):
            rows.append(row(mode, 1, result["tokens_per_s"]))
    for n, shared in sorted(report["concurrent"].items()):
        if shared.get("tokens_per_s"):
            rows.append(row(shared["mode"], int(n), shared["tokens_per_s"]))
    return rows


def _diff(repo: Path, path: Path | str, new: str) -> str:
    old = (repo / path).read_text()
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}"))


def _new_default(repo: Path, where: tuple[Path, re.Pattern], value: object) -> str:
    """The diff that makes `value` the default at `where` (a file and the pattern of its default), or ""."""
    path, pattern = where
    text = (repo / path).read_text()
    match = pattern.search(text)
    if not match or match.group(2) == str(value):
        return ""
    return _diff(repo, path, text[:match.start(2)] + str(value) + text[match.end(2):])


def changes(report: dict, repo: Path) -> tuple[list[str], str]:
    """(one line per change with the figure that justifies it, the unified diff of every file it changes)."""
    lines, diffs = [], []
    table = report.get("table")
    if table and table.get("after") and table["after"] != table["before"]:
        rows = [r for r in json.loads(table["after"])["rows"] if r["gpu"] == (report["env"] or {}).get("gpu")]
        lines += [f"kernels/attention_table.json: {r['gpu']}, head dim {r['head_dim']}, {r['dtype']} -> {r['impl']} "
                  f"({r['source'].split(': ')[-1]})" for r in rows]
        diffs.append("".join(difflib.unified_diff(table["before"].splitlines(True), table["after"].splitlines(True),
                                                  "a/kernels/attention_table.json", "b/kernels/attention_table.json")))
    rows = throughput_rows(report)
    if rows:
        text = throughput.table_text(rows, repo / "bench/throughput.json")
        diffs.append(_diff(repo, "bench/throughput.json", text))
        measured = json.loads(text)["rows"]
        gpu = rows[0]["gpu"]
        best = throughput.fastest_setting(throughput.gpu_rows(measured, gpu))
        if best:
            mode, n, _ = best
            lines += [_mode_line(report, mode), _sharing_line(report, measured, gpu, n),
                      "docs/grid.md: " + throughput.wall_time_line(gpu, throughput.gpu_rows(measured, gpu))]
            diffs += [_new_default(repo, COMPILE_DEFAULT, mode), _new_default(repo, RUNS_PER_GPU_DEFAULT, n),
                      _diff(repo, "docs/grid.md", throughput.with_wall_times((repo / "docs/grid.md").read_text(),
                                                                             measured))]
    return lines, "".join(d for d in diffs if d)


def _mode_line(report: dict, mode: str) -> str:
    e2e, profiles = report["e2e"], report["profiles"]
    times = {E2E_MODES[name]: r["step_time_ms"] for name, r in e2e.items() if isinstance(r, dict)}
    device = next((p["device_ms_per_step"] for p in profiles.values() if p.get("device_ms_per_step")), None)
    chosen = times.get(mode)
    ratio = f"; {chosen / device:.2f}x its device time {device:.2f} ms (target <= {STEP_TARGET}x)" if (
        chosen and device) else ""
    return (f"train_gpt.py --compile-mode default: {mode} ("
            + ", ".join(f"{name} {ms:.2f} ms per step" for name, ms in times.items())
            + ratio + ")")


def _sharing_line(report: dict, rows: list[dict], gpu: str, n: int) -> str:
    by_mode = throughput.gpu_rows(rows, gpu)
    mode = max(by_mode, key=lambda m: len(by_mode[m]))
    alone = by_mode[mode].get(1)
    figures = ", ".join(f"{k} runs {v:,.0f} tokens/s" for k, v in sorted(by_mode[mode].items()))
    best = max(by_mode[mode].values())
    ratio = f"; the best {best / alone:.2f}x one run's (target >= {SHARING_TARGET}x)" if alone else ""
    return f"grid --runs-per-gpu default: {n} ({mode}, per GPU: {figures}{ratio})"


def markdown(report: dict, repo: Path, compact: bool = False) -> str:
    """The report as Markdown, the changes last; `compact` (for the printed tail) lists only the tests that did not
    pass and no kernel tables."""
    env = report["env"] or {}
    lines = ["# GPU session", "",
             f"commit {report['commit']} | {env.get('gpu', '?')} | torch {env.get('torch', '?')} | Triton "
             f"{env.get('triton', '?')} | CUDA {env.get('cuda', '?')} | driver {env.get('driver', '?')} | "
             f"{report['date']} | {report.get('elapsed_s', '?')} s of a {report['budget_s']:.0f} s budget"]
    if report["stopped"]:
        lines += ["", f"**Stopped: {report['stopped']}**"]
    if env and not env.get("tokenizer_ranks", True):
        lines += ["", "Tokenizer ranks not cached (data/cache/tiktoken): carry data/cache, or the sampling test "
                      "reaches for the network."]
    lines += ["", "| step | status | s | limit s |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {r['status']} | {r.get('seconds', '')} | {r.get('limit_s', '')} |"
              for name, r in report["steps"].items()]
    lines += ["", "Left out to make room, most valuable first: " + "; ".join(report["left_out"]) + "."]
    lines += _attention_lines(report["attention"]) + _e2e_lines(report["e2e"])
    for name, profile in report["profiles"].items():
        lines += _profile_lines(f"--compile-mode {E2E_MODES[name]}", profile, kernels=not compact)
    lines += _concurrent_lines(report["concurrent"]) + _test_lines(report, compact)
    summary, diff = changes(report, repo)
    lines += ["", "## Changes these numbers justify", ""]
    if summary:
        lines += [f"- {line}" for line in summary] + ["", "Apply with `git apply` (this block), then commit it with "
                                                          "this report in BENCHMARKS.md:", "", "```diff",
                                                      diff.rstrip("\n"), "```"]
    else:
        lines += ["None: no figure was measured."]
    return "\n".join(lines) + "\n"


def _attention_lines(attention: dict | None) -> list[str]:
    if not attention or not attention.get("shapes"):
        return []
    lines = ["", "## Attention (bf16; x = fastest library path's time / this, same biases)"]
    for shape in attention["shapes"]:
        if not shape:
            continue
        auto = ", ".join(f"{k}: {v}" for k, v in (shape.get("auto") or {}).items())
        lines += ["", f"B={shape['B']} H={shape['H']} T={shape['T']} d={shape['d']} "
                      f"{'causal' if shape['causal'] else 'bidirectional'}"
                      + ("" if shape.get("complete", True) else " (cut short)") + (f"; auto picks {auto}" if auto
                                                                                     else ""),
                  "", "| variant | fwd ms | x | fwd+bwd ms | x | first s |", "| --- | --- | --- | --- | --- | --- |"]
        for name, r in shape["variants"].items():
            if "error" in r:
                lines.append(f"| {name} | {r['error'][:70]} | | | | |")
            else:
                lines.append(f"| {name} | {_num(r.get('fwd_ms'), '.3f')} | {_num(r.get('x_fwd'), '.2f')} | "
                             f"{_num(r.get('fwd_bwd_ms'), '.3f')} | {_num(r.get('x_fwd_bwd'), '.2f')} | "
                             f"{_num(r.get('first_s'), '.1f')} |")
    return lines


def _e2e_lines(e2e: dict) -> list[str]:
    rows = [(name, r) for name, r in e2e.items() if isinstance(r, dict)]
    if not rows:
        return []
    lines = ["", "## End-to-end training, one run (gpt2-124m, AdamW, bf16, torch.compile, 8 x 512 tokens per step)",
             "", "| compile mode | attention | tokens/s | ms/step | MFU | peak GiB | last loss | CUDA graph |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        graph = "; ".join(r.get("graph") or []) or "-"
        lines.append(f"| {E2E_MODES[name]} | {(r.get('attention') or {}).get('choice', '?')} | "
                     f"{r['tokens_per_s']:,.0f} | {r['step_time_ms']:.2f} | {mfu} | "
                     f"{_num(r.get('peak_memory_gib'), '.1f')} | {_num(r.get('train_loss'), '.4f')} | {graph[:160]} |")
    return lines


def _profile_lines(name: str, profile: dict, kernels: bool = True) -> list[str]:
    wall, device = profile["wall_ms_per_step"], profile.get("device_ms_per_step")
    ratio = f" = {wall / device:.2f}x the device's work" if device else ""
    lines = ["", f"## Profile of steps {profile['steps'][0]}-{profile['steps'][1]} ({name}, profiler on)", "",
             f"{wall:.2f} ms per step{ratio}; host {profile['host_ms_per_step']:.2f} ms issuing it; device busy "
             f"{_num(device, '.2f')} ms"]
    if kernels:
        lines += ["", "| kernel | ms/step | share | calls |", "| --- | --- | --- | --- |"]
        lines += [f"| {row['name'][:80]} | {row['ms_per_step']:.3f} | {100 * row['share']:.1f}% | {row['calls']} |"
                  for row in profile.get("top", [])]
    return lines


def _concurrent_lines(concurrent: dict) -> list[str]:
    if not concurrent:
        return []
    lines = ["", "## Runs sharing one GPU (gpt2-124m, AdamW, 8 x 512 tokens per step each)", "",
             "| runs | compile mode | tokens/s of the GPU | x one run | each run's ms/step | seconds side by side |",
             "| --- | --- | --- | --- | --- | --- |"]
    for n, r in sorted(concurrent.items()):
        total, alone = r.get("tokens_per_s"), r.get("alone_tokens_per_s")
        x = f"{total / alone:.2f}" if total and alone else "n/a"
        each = f"{1e3 * 4096 * int(n) / total:.2f}" if total else "n/a"
        lines.append(f"| {n} | {r['mode']} | {_num(total, ',.0f')} | {x} | {each} | {_num(r.get('overlap_s'), '.1f')} "
                     "|" + (f" {r['note']}" if r.get("note") else ""))
    return lines


def _test_lines(report: dict, compact: bool) -> list[str]:
    tests = report["tests"]
    if not tests:
        return []
    shown = {t: r for t, r in tests.items() if not compact or r["verdict"] != "passed"}
    lines = ["", f"## CUDA tests: {report['steps'].get('cuda_tests', {}).get('status', '')}"
                 + (" (passed ones not listed)" if compact else ""), "", "| test | verdict | s |",
             "| --- | --- | --- |"]
    return lines + [f"| {t.removeprefix('tests/')} | {r['verdict']} | {r.get('seconds', '')} |"
                    for t, r in shown.items()]
