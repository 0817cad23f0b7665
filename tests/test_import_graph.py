"""The import graph runs one way (neuronmm_kernels <- server <- compression <- bench) and is visible at module top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS = ("neuronmm_kernels", "server", "compression", "bench")  # each may import only those before it
SDK = ("neuronxcc", "transformers_neuronx", "torch_neuronx")  # optional: imported where they are used
# The CLI dispatch may load subcommands lazily (server/cli.py: serve, and the other packages' plugins by name).
CLI_DISPATCH = "server/cli.py"
# A child process's entry point imports its own side there, so the parent can start it without those imports
# (seconds of torch and the model's modules before the engine core could start loading).
PROCESS_ENTRY_POINTS = {("server/engine/engine_core.py", "server.engine.core_process")}
# Function-local project imports in files whose owners are still moving them to module top. Each entry
# must go; the test fails on any local import not listed here (and on a listed one that is gone).
LOCAL_IMPORT_ALLOWLIST = {
    ("server/backends/neuron/__init__.py", "server.backends.neuron.runner"),
    ("server/backends/neuron/runner.py", "server.backends.neuron"),
    ("server/backends/neuron/runner.py", "server.backends.neuron.layout"),
    ("server/backends/neuron/tnx_patch.py", "server.backends.neuron.mlp_graph"),
}
# Upward imports allowed for now: none remain, keep it that way.
UPWARD_ALLOWLIST: set = set()


def _sources() -> list[Path]:
    return sorted(p for pkg in LAYERS for p in (REPO / pkg).rglob("*.py"))


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every absolute import of the file."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            local = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, in_function))
            visit(child, local)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def _layer(module: str) -> int | None:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def _violations() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    upward, local = set(), set()
    for path in _sources():
        rel = str(path.relative_to(REPO))
        own = _layer(rel.replace("/", "."))
        for module, in_function in _imports(path):
            layer = _layer(module)
            if layer is None:
                continue
            is_api_from_backend = rel.startswith("server/backends/") and module.startswith("server.api")
            if layer > own or is_api_from_backend:
                upward.add((rel, module))
            entry_point = (rel, module) in PROCESS_ENTRY_POINTS
            if in_function and rel != CLI_DISPATCH and not module.startswith(SDK) and not entry_point:
                local.add((rel, module))
    return upward, local


def test_no_upward_imports():
    upward, _ = _violations()
    assert upward - UPWARD_ALLOWLIST == set(), "an import against the layer order (or a backend importing server.api)"
    assert UPWARD_ALLOWLIST - upward == set(), "an allowlisted upward import is gone: drop it from UPWARD_ALLOWLIST"


def test_project_imports_sit_at_module_top():
    _, local = _violations()
    assert local - LOCAL_IMPORT_ALLOWLIST == set(), "a project import inside a function: move it to module top"
    assert LOCAL_IMPORT_ALLOWLIST - local == set(), "an allowlisted local import is gone: drop it from the allowlist"


def test_kernels_import_nothing_of_the_project():
    for path in (REPO / "neuronmm_kernels").rglob("*.py"):
        others = {m for m, _ in _imports(path) if _layer(m) not in (None, 0)}
        assert not others, f"{path.relative_to(REPO)} imports {others}"


@pytest.mark.parametrize("source, module, in_function, upward", [
    ("import server.config\n", "server.config", False, False),
    ("def f():\n    from compression import rank\n", "compression", True, True),
    ("def f():\n    import neuronxcc.nki\n", "neuronxcc.nki", True, False),
])
def test_the_checker_sees_what_it_should(tmp_path, source, module, in_function, upward):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert (module, in_function) in _imports(path)
    layer = _layer(module)
    assert (layer is not None and layer > _layer("server")) == upward
