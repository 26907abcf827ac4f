"""The package's shape: imports point one way, from a stage to the stages below it, and no module
grows past about 500 lines (../STYLE.md of the team: a package per stage of the data flow)."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lora_lab"

# Lower rank first. A module may import from a lower rank, or from its own package.
RANKS = {
    "errors": 0,
    "paths": 1,
    "log": 1,
    "architecture": 1,
    "registry": 2,
    "config": 3,
    "planning": 4,
    "data": 4,
    "models": 4,
    "device": 4,
    "config_reference": 4,
    "run_folder": 5,
    "training": 6,
    "use": 6,
    "demo": 7,
    "__init__": 8,
    "ui": 9,  # the web page, over the public API like the CLI
    "cli": 10,
    "__main__": 11,
}
MAX_LINES = 525


def stage_of(module: str) -> str:
    """'lora_lab.training.run' -> 'training'; 'lora_lab' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set:
    """Every lora_lab module `path` imports, at the top or inside a function."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("lora_lab"):
                found.add(target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lora_lab")}
    return found


def modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_stage_has_a_rank():
    stages = {stage_of(module_name(p)) for p in modules()}
    assert stages <= set(RANKS), stages - set(RANKS)


def violations(edges: list) -> list:
    """(importer, imported) module pairs that import sideways or upwards across stages."""
    wrong = []
    for importer, target in edges:
        here, there = stage_of(importer), stage_of(target)
        if there != here and RANKS[there] >= RANKS[here]:
            wrong.append(f"{importer} imports {target}")
    return wrong


def test_imports_point_from_a_stage_to_the_stages_below_it():
    edges = [(module_name(p), t) for p in modules() for t in imports_of(p)]
    assert violations(edges) == []


def test_the_layout_check_finds_upward_and_sideways_imports():
    assert "lora_lab.planning.choice" in imports_of(PACKAGE / "training" / "run.py")
    assert violations(
        [
            ("lora_lab.planning.memory", "lora_lab.training.run"),
            ("lora_lab.data.encode", "lora_lab.models.load"),
            ("lora_lab.training.run", "lora_lab.training.checkpoint"),
        ]
    ) == [
        "lora_lab.planning.memory imports lora_lab.training.run",
        "lora_lab.data.encode imports lora_lab.models.load",
    ]


def test_no_module_is_over_about_500_lines():
    long = {module_name(p): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


BLOCK_TRAINING_STACK = """
import sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} imported by a test that does not need it")

sys.meta_path.insert(0, Blocker())
import pytest

sys.exit(pytest.main(sys.argv[1:]))
"""


def test_the_layout_tests_run_without_the_training_stack():
    """tests/conftest.py loads nothing of torch or transformers for a test that does not ask
    for it (the fault hooks load for tests/e2e alone)."""
    import subprocess
    import sys

    root = Path(__file__).parents[2]
    test = "tests/unit/test_layout.py::test_imports_point_from_a_stage_to_the_stages_below_it"
    args = [sys.executable, "-c", BLOCK_TRAINING_STACK, "-q", "-p", "no:cacheprovider", test]
    result = subprocess.run(args, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


MAX_FUNCTION_LINES = 60
LONGER_FUNCTIONS = {
    "lora_lab.ui.page.build_page": "gradio's page, declared top to bottom as it is shown",
    "lora_lab.use.serve_api.build_app": "the FastAPI routes, each a closure over the served models",
    "lora_lab.use.vllm_schemes.validate_quant_args": "compressed-tensors' validator, mirrored",
    "lora_lab.use.vllm_schemes.scheme_problems": "vLLM's scheme dispatch, mirrored",
    "lora_lab.models.attention.varlen_attention": "one kernel call and its shapes; split, it reads worse",
    "lora_lab.planning.traffic.plan_traffic": "one table of the engines' collectives",
    "lora_lab.planning.memory._parts": "the plan's parts, one line each",
    "lora_lab.training.args.build_training_arguments": "TrainingArguments, one keyword a line",
}
"""The functions over MAX_FUNCTION_LINES, each with the reason it is one piece (STYLE.md: about 60
lines). A new long function is split, or named here with its reason."""


def test_no_function_is_over_about_60_lines_but_the_named_ones():
    long = set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if function and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long.add(f"{module_name(path)}.{node.name}")
    assert long - set(LONGER_FUNCTIONS) == set()
    assert set(LONGER_FUNCTIONS) - long == set(), "shorter now: take it off the list"


def _imported_roots(path: Path) -> set:
    """The top-level names `path` imports, and the folders it puts on sys.path by name."""
    text = path.read_text()
    roots = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and not node.level:
            roots.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
    if re.search(r"sys\.path\.(insert|append)\(.*bench", text):
        roots.add("bench")
    return roots


def test_tests_and_bench_do_not_import_each_other():
    """The product's tests do not reach into the GPU benchmark's scripts, nor the benchmark into
    the tests (bench's own tests live in bench/tests, with bench/ on their path)."""
    root = PACKAGE.parent
    bench_modules = {p.stem for p in (root / "bench").glob("*.py")}
    for path in (root / "tests").rglob("*.py"):
        assert not _imported_roots(path) & (bench_modules | {"bench"}), path
    for path in (root / "bench").rglob("*.py"):
        assert "tests" not in _imported_roots(path), path


MAX_PARAMETERS = 6  # "about 5" beside self and the run's config or plan
MANY_PARAMETERS = {
    "lora_lab.use.export_common.export_model": "the export's options, keyword-only, as the CLI and UI pass them",
    "lora_lab.use.export.export_quantized": "keyword-only: the --format/--quantization/--calibration flags",
    "lora_lab.use.data_check.check_data": "keyword-only: the data check's flags, shared by CLI and UI",
    "lora_lab.use.data_check.data_config": "keyword-only: the data commands' flags",
    "lora_lab.use.serve.serve_runs": "keyword-only: `lora-lab serve`'s flags",
    "lora_lab.ui.launch_ui": "keyword-only: `lora-lab ui`'s flags",
    "lora_lab.models.attention.varlen_attention": "one kernel call: the tensors and their lengths",
    "lora_lab.models.attention.segments_attention": "one kernel call: the tensors and their lengths",
    "lora_lab.models.attention.sdpa_long_rows": "transformers' attention function signature",
    "lora_lab.models.fast_lora.products._project_backward": "the saved tensors of one product's backward",
    "lora_lab.models.fast_lora.mlp._down_backward": "the saved tensors of the MLP's backward",
    "lora_lab.models.fast_lora.mlp._saved_backward": "the saved tensors of the MLP's backward",
    "lora_lab.data.cache.cached_encoding": "the parts of the cache key, each a fact of the encoding",
    "lora_lab.data.cache.key_parts": "the parts of the cache key, each a fact of the encoding",
    "lora_lab.data.encode._reply_in_place": "one reply's ids, its template's markers and the sample's roles",
    "lora_lab.cli.data._data_config": "the data commands' flags, passed on",
    "lora_lab.cli.data._encode": "the data commands' flags, passed on",
}
"""Functions with more than MAX_PARAMETERS parameters (less self, config, plan), each with its
reason; click commands (one parameter a flag) and autograd Functions' forward/backward (torch
passes what they saved) are not counted."""


def _parameters(node) -> list:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return [n for n in names if n not in ("self", "cls", "ctx", "config", "plan")]


def test_no_function_takes_more_than_about_5_parameters_but_the_named_ones():
    many = set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            click = any(".command(" in d or d.endswith("_options") or d.startswith("click.") for d in decorators)
            autograd = node.name in ("forward", "backward") and "staticmethod" in decorators
            if len(_parameters(node)) > MAX_PARAMETERS and not click and not autograd:
                many.add(f"{module_name(path)}.{node.name}")
    assert many - set(MANY_PARAMETERS) == set(), "pass a settings object, or name it here with its reason"
    assert set(MANY_PARAMETERS) - many == set(), "fewer now: take it off the list"
