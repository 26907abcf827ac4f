"""A pytest plugin (tests/conftest.py registers it): `make test` runs quietly (-q, one letter per
test), but a real-model test takes minutes (the first one downloads the model and trains it), so
each of them says its name when it starts and its outcome and time when it ends, on a line of its
own. With -v pytest names every test itself, and this stays silent.

Under pytest-xdist (make test: two workers) the tests run in the workers and this process only
hears of them: a real-model test is known by its report's keywords, and says its name, outcome
and time on one line when it ends (the other worker's dots go on meanwhile)."""

from __future__ import annotations

import time

import pytest

MARKER = "real_model"
NAME = "real-model-progress"


class RealModelProgress:
    def __init__(self, config):
        self.config = config
        self.items: dict = {}
        """nodeid -> item, of the tests collected."""
        self.running: dict = {}
        """nodeid -> [start time, outcome so far] of the real-model test that is running."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid, location):
        """`[real model] NODEID ... ` on a line of its own; pytest's outcome letter follows it."""
        item = self.items.get(nodeid)
        if item is not None and item.get_closest_marker(MARKER) is not None:
            self.running[nodeid] = [time.monotonic(), "passed"]
            writer = self.config.get_terminal_writer()
            if writer.width_of_current_line:
                writer.line()
            writer.write(f"[real model] {nodeid} ... ", flush=True)

    def pytest_collection_modifyitems(self, items):
        self.items = {item.nodeid: item for item in items}

    def pytest_runtest_logreport(self, report):
        state = self.running.get(report.nodeid)
        if state is None and report.when == "setup" and MARKER in report.keywords:
            # xdist: the test ran in a worker; its time is its phases' durations
            state = self.running[report.nodeid] = [None, "passed", 0.0]
        if state is None:
            return
        if state[0] is None:
            state[2] += report.duration
        if report.failed:  # the first failing phase names the outcome
            state[1] = (
                state[1]
                if state[1] != "passed"
                else ("failed" if report.when == "call" else f"error in {report.when}")
            )
        elif report.skipped and state[1] == "passed":
            state[1] = "skipped"

    @pytest.hookimpl(tryfirst=True)  # before pytest's own: it then starts a fresh line of dots
    def pytest_runtest_logfinish(self, nodeid, location):
        state = self.running.pop(nodeid, None)
        if state is None:
            return
        writer = self.config.get_terminal_writer()
        if state[0] is not None:
            writer.line(f" {state[1]} in {time.monotonic() - state[0]:.0f} s")
            return
        if writer.width_of_current_line:
            writer.line()
        writer.line(f"[real model] {nodeid} {state[1]} in {state[2]:.0f} s")


def register(config) -> None:
    if config.get_verbosity() <= 0 and not config.pluginmanager.has_plugin(NAME):
        config.pluginmanager.register(RealModelProgress(config), NAME)


pytest_configure = register  # as a plugin of its own: pytest -p tests.support.progress
