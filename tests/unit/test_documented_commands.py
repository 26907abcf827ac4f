"""The commands README.md and docs/*.md show, held to the CLI they document (the first hour of a
new user): every `lora-lab` line of a shell block parses with click's own parser (a `run` line
also resolves its config); the lines that need no GPU, hub or trained run really run, in the
README's order, with the output the docs show; every `make` target named exists; every
`python` script or module named is there."""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from lora_lab.cli import main, run_config
from lora_lab.config import all_keys
from lora_lab.errors import LoraLabError

ROOT = Path(__file__).resolve().parents[2]
SHELL_TAGS = {"", "bash", "sh", "shell", "console"}
COMMAND = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S+ )*(lora-lab|make|pip|python) ")
# The collector must find at least this many (it cannot silently collect nothing).
FLOOR = {"lora-lab": 35, "make": 10, "inline": 20}

# What a placeholder of the docs stands for: files made real in the folder the commands run in
# (a small real dataset; the peers' files the data page shows; a run folder where click needs an
# existing path), and rewrites of the names that are not file names.
ROWS = [
    {
        "messages": [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "I am Aurora, made by Lora Lab."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."},
        ]
    },
]
DATA_FILES = ["my.jsonl", "prompts.jsonl", "heldout.jsonl", "pairs.jsonl", "heldout_pairs.jsonl"]
PEER_FILES = ["glaive_toolcall_en_demo.json", "swift_agent.jsonl"]
RUN_FOLDERS = ["output/run/adapter", "output/run/merged", "output/run/export-nf4", "output/run/model"]
REWRITES = {
    "output/<run>": "output/run",
    "RUN_DIR": "output/run",
    "RUN": "output/run",
    "PATH": "output/run",
    "FILE.gguf": "model.gguf",
    "FILE": "my.jsonl",
    "DATA...": "my.jsonl",
    "FORMAT": "nf4",
    "N": "2",
    "E": "deepspeed-zero2",
    "D": "output",
    "OUT": "encoded.jsonl",
    "NAMES": "arc_easy,hellaswag",
}
ELISION = "..."  # in a command: the flags of the line above with that command (else none)
# Spans of the prose that are a form, not a command; each with the reason. Keep this short.
PLACEHOLDER_FORMS = {
    "lora-lab export --quantize w4a16": "names export's option; the PATH is left out",
    "lora-lab plan --data": "names plan's flag; the file is left out",
    "lora-lab eval --tasks": "names eval's option; the run and the task names are left out",
}
# Commands that need no GPU, no hub and no trained run: these really run.
RUNS_HERE = {("presets",), ("plan",), ("data", "validate"), ("data", "stats"), ("data", "preview"), ("data", "encode")}
PLAN_SECONDS = 3.0  # `plan` imports no torch: the whole process, interpreter start included


@dataclass(frozen=True)
class DocCommand:
    where: str  # page:line of the command's first line
    text: str  # continuations joined, `$ ` and the trailing comment dropped
    words: tuple  # its shell words; `python -m lora_lab` read as `lora-lab`, `...` filled in
    output: tuple  # the lines a console block shows after `$ command`

    @property
    def tool(self) -> str:
        return self.words[0]


def doc_pages() -> list[Path]:
    """README.md, then docs/ in the order the README's documentation table lists them."""
    readme = ROOT / "README.md"
    table = re.findall(r"\| \[[^]]+\]\((docs/[\w-]+\.md)\)", readme.read_text())
    listed = [ROOT / p for p in table]
    rest = sorted(p for p in (ROOT / "docs").glob("*.md") if p not in listed)
    return [readme, *listed, *rest]


def shell_lines(page: Path):
    """(block, line number, text) of every line inside a bash/sh/console/untagged fenced block,
    block counting the page's fenced blocks."""
    tag, block = None, 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```\s*([\w-]*)", line)
        if fence:
            tag = fence.group(1) if tag is None else None
            block += 1
        elif tag in SHELL_TAGS:
            yield block, number, line


def collect_commands() -> list[DocCommand]:
    commands = []
    for page in doc_pages():
        lines = list(shell_lines(page))
        last_of_block = {}  # (block, (tool, command)) -> the words of its last such line
        console_block = None  # the block of the last `$ command`: later lines are its output
        index = 0
        while index < len(lines):
            block, number, line = lines[index]
            while line.rstrip().endswith("\\") and index + 1 < len(lines):
                index += 1
                line = line.rstrip()[:-1] + " " + lines[index][2].strip()
            index += 1
            stripped = line.strip()
            if not COMMAND.match(stripped):
                if stripped.startswith("$ "):
                    console_block = None
                elif block == console_block and stripped:
                    last = commands[-1]
                    commands[-1] = DocCommand(last.where, last.text, last.words, last.output + (stripped,))
                continue
            console = stripped.startswith("$ ")
            console_block = block if console else None
            words = shlex.split(stripped[2:] if console else stripped, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S+", words[0]):
                words.pop(0)  # LORA_LAB_...=VALUE lora-lab ...
            if words[:3] == ["python", "-m", "lora_lab"]:
                words = ["lora-lab", *words[3:]]
            text = " ".join(words)
            if ELISION in words:  # `lora-lab run ... --resume auto`: the line above's flags
                above = last_of_block.get((block, tuple(words[:2])), words[:2])
                at = words.index(ELISION)
                words[at : at + 1] = above[2:]
            last_of_block[block, tuple(words[:2])] = words
            commands.append(DocCommand(f"{page.relative_to(ROOT)}:{number}", text, tuple(words), ()))
    return commands


def collect_inline_commands() -> list[DocCommand]:
    """`lora-lab ...` code spans of the prose (outside fenced blocks), one per alternative of
    `a|b`."""
    commands = []
    for page in doc_pages():
        text = page.read_text()
        prose = re.sub(r"```.*?```", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
        for span in re.finditer(r"`((?:[A-Z_]+=\S+ )*(?:lora-lab|python -m lora_lab) [^`]+)`", prose):
            words = shlex.split(" ".join(span.group(1).split()))
            while re.fullmatch(r"[A-Z_]+=\S+", words[0]):
                words.pop(0)
            if words[:3] == ["python", "-m", "lora_lab"]:
                words = ["lora-lab", *words[3:]]
            where = f"{page.relative_to(ROOT)}:{prose.count(chr(10), 0, span.start()) + 1}"
            alternatives = [w.split("|") for w in words]
            for choice in range(max(len(a) for a in alternatives)):
                chosen = [a[min(choice, len(a) - 1)] for a in alternatives]
                commands.append(DocCommand(where, " ".join(chosen), tuple(chosen), ()))
    return commands


def command_path(words) -> tuple:
    """The subcommand words of `lora-lab WORDS...`: ("data", "validate"), ("plan",)."""
    path, group = [], main
    for word in words[1:]:
        command = group.commands.get(word) if isinstance(group, click.Group) else None
        if command is None:
            break
        path.append(word)
        group = command
    return tuple(path)


COMMANDS = collect_commands()
LORA_LAB = [c for c in COMMANDS if c.tool == "lora-lab" and c.text not in PLACEHOLDER_FORMS]
MAKE = [c for c in COMMANDS if c.tool == "make"]
NAMED = collect_inline_commands()
# A span naming only a command (`lora-lab merge`) is a reference: its command must exist. The
# others are lines to parse.
INLINE = [c for c in NAMED if len(c.words) > 1 + len(command_path(c.words)) and c.text not in PLACEHOLDER_FORMS]


def substitute(command: DocCommand) -> list[str]:
    """The command's arguments (after `lora-lab`) with the docs' placeholders made real."""
    args = []
    for word in command.words[1:]:
        if word == ELISION:
            continue
        for placeholder, real in REWRITES.items():
            word = re.sub(rf"(?<![\w-]){re.escape(placeholder)}(?![\w.])", real, word)
        if re.search(r"<[^>]*>", word) or re.fullmatch(r"[A-Z][A-Z_]+", word):
            pytest.fail(
                f"{command.where}: `{command.text}`: placeholder {word!r} has no "
                f"substitution: add it to REWRITES or the line to PLACEHOLDER_FORMS"
            )
        args.append(word)
    return args


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The folder the documented commands run in, holding what their placeholders name."""
    folder = tmp_path_factory.mktemp("newcomer")
    for name in DATA_FILES:
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    for name in PEER_FILES:
        shutil.copy(ROOT / "tests" / "assets" / "peers" / name, folder / name)
    for name in RUN_FOLDERS:
        (folder / name).mkdir(parents=True)
    (folder / "my_rewards.py").write_text(
        "def short_and_right(completions, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    return folder


def parse(args: list[str]):
    """Walk click's own parser over `lora-lab ARGS`: (command, its context). Raises
    click.UsageError for an unknown option, a wrong Choice value, a missing argument."""
    ctx = main.make_context("lora-lab", list(args), resilient_parsing=False)
    group = main
    while True:
        rest = [*ctx._protected_args, *ctx.args]  # what the group left to its subcommand
        name, command, rest = group.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx, resilient_parsing=False)
        if not isinstance(command, click.Group):
            return command, ctx
        group = command


def test_the_collector_finds_the_documented_commands():
    counts = {tool: sum(c.tool == tool for c in COMMANDS) for tool in ("lora-lab", "make")}
    counts["inline"] = len(INLINE)
    print(
        f"documented commands: {counts} (inline: lora-lab code spans of the prose); "
        f"{len(COMMANDS)} lines of shell blocks in all"
    )
    for tool, floor in FLOOR.items():
        assert counts[tool] >= floor, (tool, counts[tool])
    assert LORA_LAB[0].where.startswith("README.md:")  # the README's order first
    shown = next(c for c in COMMANDS if c.words == ("lora-lab", "data", "validate", "self-cognition"))
    assert shown.output[-1].startswith("120 rows usable")


def parses(command: DocCommand, workdir: Path, monkeypatch):
    """(click command, its context) of the line, or None for --help; fails the test, naming the
    page, line and command, on what click or the config keys refuse."""
    monkeypatch.chdir(workdir)  # click.Path(exists=True) looks here
    args = substitute(command)
    try:
        cli_command, ctx = parse(args)
    except click.exceptions.Exit as exit_:  # --help, --version
        assert exit_.exit_code == 0
        return None
    except click.UsageError as exc:
        pytest.fail(f"{command.where}: `{command.text}`: {exc.format_message()}")
    for key in (s.split("=")[0] for s in ctx.params.get("sets", ())):
        if key not in all_keys() and not shows_an_error(command):
            pytest.fail(f"{command.where}: `{command.text}`: --set {key}: no such config key")
    return cli_command, ctx


@pytest.mark.parametrize("command", LORA_LAB, ids=lambda c: f"{c.where} {c.text}")
def test_documented_command_parses(command, workdir, monkeypatch):
    parsed = parses(command, workdir, monkeypatch)
    if parsed and parsed[0].name == "run" and not shows_an_error(command):
        # run's values are text to click: the config it resolves says whether they are valid
        params = dict(parsed[1].params)
        missing = missing_report_packages(command.words)
        if missing:  # optional packages: the config refuses a tracker that is not installed
            pytest.skip(f"--report-to needs {', '.join(missing)}, not installed here")
        try:
            run_config(
                params.pop("preset"),
                params.pop("config_file"),
                params.pop("sets"),
                {k: v for k, v in params.items() if k not in ("dry_run", "show_config")},
            )
        except LoraLabError as exc:
            pytest.fail(f"{command.where}: `{command.text}`: {exc}")


@pytest.mark.parametrize("command", INLINE, ids=lambda c: f"{c.where} {c.text}")
def test_command_named_in_the_prose_parses(command, workdir, monkeypatch):
    parses(command, workdir, monkeypatch)


def missing_report_packages(words) -> list:
    """The packages a command's --report-to names that are not installed here."""
    import importlib.util

    from lora_lab.config.fields import REPORT_BACKENDS

    names = [n for flag, value in zip(words, words[1:]) if flag == "--report-to" for n in value.split(",")]
    return [
        REPORT_BACKENDS[n]
        for n in names
        if REPORT_BACKENDS.get(n) and importlib.util.find_spec(REPORT_BACKENDS[n]) is None
    ]


def shows_an_error(command: DocCommand) -> bool:
    """The docs show this line failing (its output starts with `error:`): it exits 2."""
    return bool(command.output) and command.output[0].startswith("error:")


RUNNABLE = [c for c in LORA_LAB if command_path(c.words) in RUNS_HERE or shows_an_error(c)]


def fresh_process(command: DocCommand) -> bool:
    """`presets` and `plan` (without --data) run as a process of their own, timed: the planner
    imports no torch, so the answer is instant. The rest run in this process (CliRunner), where
    the tokenizer library the data commands load is imported once."""
    path = command_path(command.words)
    return path == ("presets",) or path == ("plan",) and "--data" not in command.words


def run_command(command: DocCommand, workdir: Path, monkeypatch) -> tuple[int, str]:
    """(exit status, everything printed) of the line, run in workdir."""
    args = substitute(command)
    if fresh_process(command):
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "lora_lab", *args],
            cwd=workdir,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        seconds = time.perf_counter() - start
        print(f"{command.where} `{command.text}`: {seconds:.2f} s, a process of its own")
        if command_path(command.words) == ("plan",):
            assert seconds < PLAN_SECONDS, f"{command.where}: plan took {seconds:.2f} s"
        return result.returncode, result.stdout + result.stderr
    monkeypatch.chdir(workdir)
    result = CliRunner().invoke(main, args, prog_name="lora-lab")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        pytest.fail(
            f"{command.where}: `{command.text}` raised:\n" + "".join(traceback.format_exception(*result.exc_info))
        )
    return result.exit_code, result.output


@pytest.mark.parametrize("command", RUNNABLE, ids=lambda c: f"{c.where} {c.text}")
def test_documented_command_runs(command, workdir, monkeypatch):
    """The line runs, in the README's order: exit 0, or 2 where the docs show an error; no
    traceback; every line the docs show under it is printed."""
    status, printed = run_command(command, workdir, monkeypatch)
    expected = 2 if shows_an_error(command) else 0
    assert status == expected, f"{command.where}: `{command.text}`: exit {status}\n{printed}"
    assert "Traceback" not in printed, printed
    lines = [line.strip() for line in printed.splitlines()]
    for shown in command.output:
        if shown != ELISION:
            assert shown in lines, f"{command.where}: the docs show {shown!r}; printed:\n{printed}"


def every_command(group=main, path=()):
    for name, command in sorted(group.commands.items()):
        yield (*path, name)
        if isinstance(command, click.Group):
            yield from every_command(command, (*path, name))


@pytest.mark.parametrize("path", [(), *every_command()], ids=lambda p: " ".join(p) or "lora-lab")
def test_every_command_has_help(path):
    result = CliRunner().invoke(main, [*path, "--help"], prog_name="lora-lab")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Usage: lora-lab") and "Traceback" not in result.output


def test_every_documented_subcommand_exists():
    for command in LORA_LAB + NAMED:
        words = [w for w in command.words[1:] if not w.startswith("-")]
        path = command_path(command.words)
        leaf = main
        for name in path:
            leaf = leaf.commands[name]
        if words and not path or isinstance(leaf, click.Group) and len(words) > len(path):
            pytest.fail(f"{command.where}: `{command.text}`: no command {' '.join(words[: len(path) + 1])!r}")


@pytest.mark.parametrize("command", MAKE, ids=lambda c: f"{c.where} {c.text}")
def test_documented_make_target_exists(command, workdir, monkeypatch):
    """`make -n` knows the target; a lora-lab line it would run parses too."""
    result = subprocess.run(
        ["make", "-n", "-o", ".install.stamp", *command.words[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"{command.where}: `{command.text}`: {result.stderr}"
    for line in result.stdout.splitlines():
        if line.startswith("lora-lab "):
            monkeypatch.chdir(workdir)
            try:
                parse(shlex.split(line)[1:])
            except click.UsageError as exc:
                pytest.fail(f"{command.where}: `{command.text}` runs `{line}`: {exc.format_message()}")


def test_documented_python_scripts_modules_and_extras_exist():
    extras = configparser.ConfigParser()
    extras.read(ROOT / "setup.cfg")
    for command in COMMANDS:
        words = command.words
        if words[0] == "python" and words[1] == "-m":
            assert importlib.util.find_spec(words[2]), f"{command.where}: no module {words[2]}"
        elif words[0] == "python":
            assert (ROOT / words[1]).is_file(), f"{command.where}: no script {words[1]}"
        elif words[0] == "pip":
            for extra in re.findall(r"lora-lab\[([\w,-]+)\]", command.text):
                for name in extra.split(","):
                    assert extras.has_option("options.extras_require", name), (
                        f"{command.where}: no extra {name!r} in setup.cfg"
                    )
