"""The fault hooks (tests/support/faults.py) in pytest's own process, for the end-to-end tests
that set LORA_LAB_TEST_* around an in-process run; loaded only for tests/e2e, so that the
rest of the suite does not import the training stack for them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def fault_hooks():
    from tests.support.faults import install

    install()
