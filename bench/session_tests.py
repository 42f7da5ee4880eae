"""A pytest plugin for the GPU session (bench/gpu_session.py): each test's start and verdict as one line of the file
named by $SYMGPT_SESSION_EVENTS, written as it happens, so a run stopped at a time limit still tells which tests
passed, which failed and which one was running.

    SYMGPT_SESSION_EVENTS=events.txt python -m pytest -p bench.session_tests -m cuda tests/

Lines: `collected NODEID`, `start NODEID`, `<passed|failed|skipped|error> NODEID SECONDS`.
"""
from __future__ import annotations

import os

import pytest

EVENTS_ENV = "SYMGPT_SESSION_EVENTS"


def _event(text: str) -> None:
    path = os.environ.get(EVENTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        _event(f"collected {item.nodeid}")


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _event(f"start {nodeid}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """The verdict: the call's outcome, or a setup that failed or skipped, or a teardown that failed."""
    if report.when == "call" or (report.when == "setup" and not report.passed) or (
            report.when == "teardown" and report.failed):
        outcome = "error" if report.when != "call" and report.failed else report.outcome
        _event(f"{outcome} {report.nodeid} {report.duration:.1f}")
