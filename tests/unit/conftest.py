"""tests/unit: tests that run in-process, in seconds. A test here that starts gpuaccept's child process, torchrun, the
console script or a terminal fails, naming what it started: it belongs in tests/integration."""

from __future__ import annotations

import pytest

from tests.conftest import started_integration_processes


@pytest.fixture(autouse=True)
def _stays_in_process(request):
    yield
    started = started_integration_processes(request.node.nodeid)
    if started:
        pytest.fail(f"a unit test started {len(started)} integration process(es), e.g. {started[0]!r}: move it to "
                    "tests/integration (tests/conftest.py, INTEGRATION_PROCESSES)")
