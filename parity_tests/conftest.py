"""Simulated devices for the whole suite: 8 JAX host devices (set before JAX starts), float64 on."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import pytest  # noqa: E402

from parity_tests.harness.workers import WorkerPool  # noqa: E402


@pytest.fixture(scope="session")
def pool():
    """The gloo worker pool, started on first use and shared by every test of the session."""
    workers = WorkerPool()
    yield workers
    workers.close()


def pytest_terminal_summary(terminalreporter):
    """CP_TEST_MARGINS=1: each test's worst difference against its bound (parity_tests.harness.bounds)."""
    from parity_tests.harness import bounds

    if bounds.WORST and os.environ.get(bounds.ENV_VAR, "0") == "1":
        terminalreporter.section("margins")
        for line in bounds.report():
            terminalreporter.write_line(line)
