"""Errors meant for people: the CLI prints them as one clean message, never a traceback."""


class LoraLabError(Exception):
    """A problem the user can fix. The message names the flag, key, file or line, and the fix."""


class ConfigError(LoraLabError):
    """One or more configuration problems, reported together."""

    def __init__(self, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")


class ModelError(LoraLabError):
    """The model cannot be found, loaded or is not supported."""


class DataError(LoraLabError):
    """A dataset cannot be read, or none of its rows can be used."""


class CheckpointError(LoraLabError):
    """A run folder, adapter or checkpoint is missing, incomplete or does not match."""


class TrainingError(LoraLabError):
    """Training stopped on purpose: a non-finite loss or gradient, or out of GPU memory."""


class RunStopped(LoraLabError):
    """A run stopped by SIGTERM or SIGINT after writing a checkpoint; the exit status is the
    shell's for that signal (143, 130)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
