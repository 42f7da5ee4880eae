"""bench/gpu_session.py on the CPU: a step that hangs is stopped at its limit and the others still run and report."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench import gpu_session


def test_a_hung_step_is_stopped_and_the_report_keeps_the_rest(tmp_path: Path) -> None:
    steps = [
        gpu_session.Step("env", 20, [sys.executable, "-c", 'print(\'{"gpu": "none", "torch": "x"}\')']),
        gpu_session.Step("hangs", 1, [sys.executable, "-c", "import time; print('started', flush=True); "
                                                            "time.sleep(60)"]),
        gpu_session.Step("fails", 20, [sys.executable, "-c", "raise SystemExit(3)"]),
        gpu_session.Step("late", 20, [sys.executable, "-c", "print('never')"]),
    ]
    start = time.monotonic()
    for step in steps[:3]:
        gpu_session.run_step(step, tmp_path, deadline=time.monotonic() + 60)
    gpu_session.run_step(steps[3], tmp_path, deadline=time.monotonic() + 2)  # the budget is spent
    assert time.monotonic() - start < 30
    gpu_session.write_report(steps, tmp_path)

    report = json.loads((tmp_path / "gpu_session.json").read_text())
    status = {name: r["status"] for name, r in report["steps"].items()}
    assert status == {"env": "ok", "hangs": "timed out after 1 s", "fails": "failed (exit 3)",
                      "late": "not run: no time left in the budget"}
    assert report["env"] == {"gpu": "none", "torch": "x"}
    assert (tmp_path / "hangs.log").read_text() == "started\n"
    markdown = (tmp_path / "gpu_session.md").read_text()
    assert "| hangs | timed out after 1 s |" in markdown and "GPU: none | torch x" in markdown


def test_the_session_fits_its_budget() -> None:
    steps = gpu_session.session_steps(Path("out"), "python")
    assert sum(s.limit_s for s in steps) <= gpu_session.BUDGET_S < 600
    assert [s.name for s in steps if s.name.startswith("e2e")] == [
        f"e2e_{batch}_{impl}" for batch in ("paper", "32k") for impl in ("triton", "sdpa", "flex")]
