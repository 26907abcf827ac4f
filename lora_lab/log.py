"""One logger for everything lora-lab says while it works.

Messages go to standard output as plain lines. With several processes (accelerate launch) only
global rank 0 speaks; the other ranks' warnings and errors are kept, prefixed with their rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

LOGGER_NAME = "lora_lab"


class _RankFilter(logging.Filter):
    """Rank 0 says everything; other ranks only warnings and errors, tagged with the rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0:
            return True
        if record.levelno < logging.WARNING:
            return False
        record.msg = f"[rank {rank}] {record.msg}"
        return True


class _CurrentStdout(logging.StreamHandler):
    """A handler that writes to whatever sys.stdout is when a message is emitted (so that
    click's test runner, pytest's capture and redirections all see it)."""

    def __init__(self):
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def get_logger() -> logging.Logger:
    """The "lora_lab" logger, set up once: plain lines to stdout, rank-filtered, INFO."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _CurrentStdout) for h in logger.handlers):
        handler = _CurrentStdout()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


@contextlib.contextmanager
def quiet_library_progress() -> Iterator[None]:
    """Without a terminal, no tqdm bars from transformers and the hub (loading weights, writing
    shards, downloads) inside the context: redrawn with carriage returns, they fill a log file
    with their frames and run into the next line lora-lab says. Put back as they were on exit."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    hub_off, transformers_on = are_progress_bars_disabled(), transformers_logging.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        transformers_logging.disable_progress_bar()
        disable_progress_bars()
    try:
        yield
    finally:
        if not hub_off:
            enable_progress_bars()
        if transformers_on:
            transformers_logging.enable_progress_bar()
