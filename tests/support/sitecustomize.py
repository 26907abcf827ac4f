"""Started with tests/support on PYTHONPATH (tests/conftest.py sets it), a Python process that a
test sets LORA_LAB_TEST_* for gets the fault hooks (faults.py) before lora-lab trains."""

import os

if any(name.startswith("LORA_LAB_TEST_") for name in os.environ):
    from faults import install

    install()
