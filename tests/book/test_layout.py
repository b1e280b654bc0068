"""The package is one straight stack: the engine core at the bottom, the book-only code on top (README, "Layout").

Core: what upstream nano-vllm has (utils, sampling parameters, the layers, the models, config, the engine, the
`LLM` front door). Book-only, above it, from the bottom up: the literate helper, tiny test models and the SmolLM2
conversion (`nanovllm.book`); the visualization (`nanovllm.viz`); the server on top of the engine, whose live page
the visualization draws (`nanovllm.serve`); the benchmarks, one of which drives the server (`nanovllm.bench`); the
demo's command line (`nanovllm.__main__`). A module may import its own layer and the layers below it, so the core
never imports book-only code. Read statically: no module is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nanovllm"
# The core's layers, lowest first.
CORE = ("nanovllm.utils", "nanovllm.sampling_params", "nanovllm.layers", "nanovllm.models", "nanovllm.config",
        "nanovllm.engine", "nanovllm.llm", "nanovllm.__init__")
# The book-only layers on top of the core, lowest first.
BOOK_ONLY = ("nanovllm.book", "nanovllm.viz", "nanovllm.serve", "nanovllm.bench", "nanovllm.__main__")
LAYERS = CORE + BOOK_ONLY


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer(name: str) -> int:
    # `import nanovllm` is the front door: the package's __init__.
    name = "nanovllm.__init__" if name == "nanovllm" else name
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


def modules() -> dict[str, set[str]]:
    return {module_name(p): imported(p) for p in sorted(PACKAGE.rglob("*.py"))}


def core_modules() -> dict[str, set[str]]:
    return {name: deps for name, deps in modules().items() if any(within(name, c) for c in CORE)}


def test_every_module_belongs_to_a_layer() -> None:
    for name in modules():
        assert any(within(name, prefix) for prefix in LAYERS), f"{name} belongs to no layer of the package"


def test_the_core_never_imports_book_only_code() -> None:
    for name, deps in core_modules().items():
        leaks = sorted(dep for dep in deps if any(within(dep, b) for b in BOOK_ONLY))
        assert not leaks, f"{name} imports book-only code: {leaks}"


def test_the_package_is_a_straight_stack() -> None:
    for name, deps in modules().items():
        upward = sorted(dep for dep in deps if layer(dep) > layer(name))
        assert not upward, f"{name} (layer {LAYERS[layer(name)]}) imports a higher layer: {upward}"


def reached_from(start: str, graph: dict[str, set[str]]) -> set[str]:
    """Every nanovllm module that importing ``start`` imports, directly or through others (package markers aside)."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), set()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_settings_reach_no_layer_and_no_model() -> None:
    """Config holds the names its settings accept (attention backends, KV cache dtypes) itself, and reads a model
    directory through the loader, whose registry names the models by module and imports one only to build it: no
    layer and no model comes with the settings, directly or through another module."""
    reached = reached_from("nanovllm.config", modules())
    assert "nanovllm.models.loader" in reached, sorted(reached)
    assert not [dep for dep in reached if within(dep, "nanovllm.layers") or within(dep, "nanovllm.engine")], sorted(
        reached)
    assert {dep for dep in reached if within(dep, "nanovllm.models")} <= {"nanovllm.models.loader",
                                                                            "nanovllm.models.registry"}, sorted(reached)


def test_reached_from_follows_imports_through_other_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}}
    assert reached_from("a", graph) == {"a", "b", "c"}


def test_the_layout_is_what_the_readme_says() -> None:
    """The README's layout shows every book-only layer, bottom-up in the order of the stack."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = []
    for prefix in BOOK_ONLY:
        entry = prefix.removeprefix("nanovllm.")
        entry = f"{entry}.py" if entry.startswith("__") else f"{entry}/"
        found = re.search(rf"^  {re.escape(entry)} ", readme, re.M)
        assert found, f"the README's layout does not show {prefix}"
        shown.append(found.start())
    assert shown == sorted(shown), f"the README's layout shows the book-only layers out of order: {BOOK_ONLY}"


def private_imports(path: Path) -> list[str]:
    """The private names (``_name``, dunders aside) that a file takes from another nanovllm module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and within(node.module, "nanovllm"):
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_module_takes_another_modules_private_names() -> None:
    found = {module_name(path): names for path in sorted(PACKAGE.rglob("*.py")) if (names := private_imports(path))}
    assert not found, f"make these public, or move the code that needs them: {found}"


def test_a_private_import_is_found(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from nanovllm.layers.context import Context, _slot\nfrom nanovllm import __version__\n")
    assert private_imports(source) == ["nanovllm.layers.context._slot"]
