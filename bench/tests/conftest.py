"""bench's own tests (run by `make test`): the report, the planner against the stored GPU runs,
the stand-in data. bench's modules are imported as the scripts import each other (bench/ on
sys.path); tests/ and bench/ do not import each other."""

import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
