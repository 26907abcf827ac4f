"""One owner per on-disk format: only the lora_lab/run_folder package spells the names of a run
folder's files (names.py; RunFolder and Checkpoint hold them); every other module asks those. Docstrings and help text
may name a file for the reader; strings the code uses may not."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lora_lab"
OWNER = PACKAGE / "run_folder"

NAMES = re.compile(
    r"(?<![\w.])("
    r"config\.yaml|run_config\.yaml|adapter_config\.json|trainer_state\.json|manifest\.json"
    r"|run_summary\.json|train_log\.jsonl|data_problems\.jsonl|console\.log|stopped\.json"
    r"|adapter_init|checkpoint-(?=\{|\*|$|\d)"
    r"|accelerate\.yaml|deepspeed\.json|node-(?=\{|$)|eval_report\.json|export_report\.json|\.merged-tmp"
    r"|optimizer\.pt|scheduler\.pt|rng_state|training_args\.(?:bin|json)"
    r")"
)
"""A run folder's names; `checkpoint-` followed by a formatted step, a glob star, a digit or the
end of a string part (an f-string's `checkpoint-{step}`)."""


def prose(tree: ast.AST) -> set[int]:
    """The string nodes written for a reader: docstrings (a module's, class's or function's first
    string, an attribute's string after it) and help text (click's help=, a config field's _f)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for i, statement in enumerate(node.body):
                follows = i == 0 or isinstance(node.body[i - 1], (ast.Assign, ast.AnnAssign))
                if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and follows:
                    found.add(id(statement.value))
        elif isinstance(node, ast.Call):
            helps = [k.value for k in node.keywords if k.arg == "help"]
            if isinstance(node.func, ast.Name) and node.func.id == "_f":
                helps += node.args[1:2]
            found |= {id(part) for text in helps for part in ast.walk(text)}
    return found


def spelled_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = prose(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            for match in NAMES.finditer(node.value):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {match.group(1)!r}")
    return hits


def test_the_names_are_found_where_they_are_spelled():
    assert spelled_names(OWNER / "names.py"), "the pattern no longer matches the run folder's own names"


def test_no_module_but_run_folder_spells_a_run_folder_name():
    hits = [hit for path in sorted(PACKAGE.rglob("*.py")) if OWNER not in path.parents for hit in spelled_names(path)]
    assert not hits, "use lora_lab.run_folder.RunFolder / Checkpoint instead:\n" + "\n".join(hits)
