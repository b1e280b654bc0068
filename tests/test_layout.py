"""The engine core is a straight stack and never imports the book-only code (README, "Layout").

Core: what upstream nano-vllm has (config, sampling parameters, the engine, the layers, the models,
utils, the `LLM` front door). Book-only: the literate helper, tiny test models and the SmolLM2
conversion (`nanovllm.book`), the visualization (`nanovllm.viz`), the benchmarks (`nanovllm.bench`),
the demo's command line (`nanovllm.__main__`) and the server on top of the engine (`nanovllm.serve`, which
may import all of these). Read statically: no module is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanovllm"
BOOK_ONLY = ("nanovllm.book", "nanovllm.viz", "nanovllm.bench", "nanovllm.__main__", "nanovllm.serve")
# The core's layers, lowest first: a module may import its own layer and the layers below it.
LAYERS = ("nanovllm.utils", "nanovllm.sampling_params", "nanovllm.layers", "nanovllm.models", "nanovllm.config",
          "nanovllm.engine", "nanovllm.llm", "nanovllm.__init__")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer(name: str) -> int:
    return next(i for i, prefix in enumerate(LAYERS) if within(name, prefix))


def imported(path: Path) -> set[str]:
    """Every nanovllm module a file imports: import statements, and importlib.import_module("...") strings."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return {name for name in names if within(name, "nanovllm")}


def core_modules() -> dict[str, set[str]]:
    modules = {module_name(p): imported(p) for p in sorted(PACKAGE.rglob("*.py"))}
    return {name: deps for name, deps in modules.items() if not any(within(name, b) for b in BOOK_ONLY)}


def test_every_module_is_core_or_book_only() -> None:
    for name in core_modules():
        assert any(within(name, prefix) for prefix in LAYERS), f"{name} belongs to no layer of the core"


def test_the_core_never_imports_book_only_code() -> None:
    for name, deps in core_modules().items():
        leaks = sorted(dep for dep in deps if any(within(dep, b) for b in BOOK_ONLY))
        assert not leaks, f"{name} imports book-only code: {leaks}"


def test_the_core_is_a_straight_stack() -> None:
    for name, deps in core_modules().items():
        upward = sorted(dep for dep in deps if dep != "nanovllm" and layer(dep) > layer(name))
        assert not upward, f"{name} (layer {LAYERS[layer(name)]}) imports a higher layer: {upward}"


def test_the_layout_is_what_the_readme_says() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for prefix in BOOK_ONLY[:3]:
        assert f"{prefix.removeprefix('nanovllm.')}/" in readme, f"the README's layout does not show {prefix}"
