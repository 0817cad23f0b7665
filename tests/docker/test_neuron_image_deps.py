"""The trn1 image installs neuronmm with --no-deps over the Neuron DLC: every third-party module that the shipped
packages import when they load must come with the DLC or from docker/requirements-neuron.txt, the one list the
image and the compat CI job both install."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "docker" / "requirements-neuron.txt"
FIRST_PARTY = {"server", "compression", "neuronmm_kernels", "bench"}
LOADED_BY_SERVE = ("server", "compression", "neuronmm_kernels")  # `neuronmm serve` and `--help` import these
# What the DLC (pytorch-inference-neuronx 2.7.0, SDK 2.25.0) ships that neuronmm uses, the Neuron SDK included.
DLC = {"torch", "transformers", "numpy", "scipy", "tokenizers", "huggingface-hub",
       "neuronx-cc", "torch-neuronx", "transformers-neuronx"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(path: Path) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {_norm(re.split(r"[=<>~!\[; ]", line)[0]) for line in lines if line and not line.startswith("-")}


def _imports_at_load(tree: ast.AST) -> set[str]:
    """Top-level names imported when the module loads: not inside functions, under `if TYPE_CHECKING:`, or in a
    `try:` whose ImportError has a fallback (the Neuron SDK's nki, our emulator elsewhere)."""
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Try) and any(h.type is not None and "ImportError" in ast.unparse(h.type)
                                             for h in node.handlers):
            node = ast.Module(body=node.handlers + node.orelse + node.finalbody, type_ignores=[])
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        found |= _imports_at_load(node)
    return found


def _third_party_modules() -> dict[str, list[str]]:
    """module -> the shipped files that import it at load time."""
    users: dict[str, list[str]] = {}
    for pkg in LOADED_BY_SERVE:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for name in _imports_at_load(ast.parse(path.read_text())):
                if name not in sys.stdlib_module_names and name not in FIRST_PARTY and name != "__future__":
                    users.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return users


def _with_dependencies(names: set[str]) -> set[str]:
    """`names` and what they pull in (read from this venv's installed metadata), transitively."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_norm(re.split(r"[=<>~!\[; (]", r)[0]) for r in requires if "extra ==" not in r]
    return seen


def test_both_installs_read_the_one_list():
    dockerfile = (ROOT / "docker" / "Dockerfile.neuron").read_text()
    assert "COPY docker/requirements-neuron.txt " in dockerfile and "-r /tmp/requirements-neuron.txt" in dockerfile
    compat = (ROOT / "tests" / "compat" / "requirements-dlc.txt").read_text()
    assert re.search(r"^-r \.\./\.\./docker/requirements-neuron\.txt\b", compat, flags=re.M)


def test_every_module_the_server_loads_is_in_the_image():
    provided = _with_dependencies(_requirement_names(REQUIREMENTS) | DLC)
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for module, files in _third_party_modules().items():
        dists = {_norm(d) for d in distributions.get(module, [module])}
        if not dists & provided:
            missing[module] = files[:3]
    assert not missing, f"imported at load time but neither in the DLC nor in {REQUIREMENTS.name}: {missing}"


def test_the_list_is_pinned_and_holds_nothing_the_server_never_loads():
    lines = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    pins = [line for line in lines if line]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.+]*", pin) for pin in pins), pins
    distributions = importlib.metadata.packages_distributions()
    loaded = {_norm(d) for module in _third_party_modules() for d in distributions.get(module, [module])}
    # uvloop and httptools are loaded by uvicorn itself when installed (its fast loop and parser)
    unused = _requirement_names(REQUIREMENTS) - _with_dependencies(loaded) - {"uvloop", "httptools"}
    assert not unused, f"{REQUIREMENTS.name} pins packages nothing loads: {sorted(unused)}"
