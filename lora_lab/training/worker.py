"""A launched worker: `python -m lora_lab.training.worker --config RUN_DIR/launch/run_config.yaml`.

accelerate launch starts one per process. Each reads the plan its launcher settled and wrote
(training/plan.py write_plan / read_plan) and trains with it: no second resolution of flags and
presets, no second choice of engine, precision or run folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import LoraLabError, RunStopped
from ..log import get_logger
from .plan import read_plan

log = get_logger()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "--config":
        print("usage: python -m lora_lab.training.worker --config PLAN_FILE", file=sys.stderr)
        return 2
    from .run import train

    try:
        plan = read_plan(Path(argv[1]))
        train(plan.config, plan)
    except RunStopped as exc:
        print(str(exc), file=sys.stderr)
        return exc.exit_code
    except LoraLabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
