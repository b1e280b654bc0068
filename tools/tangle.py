"""Tangle the book's chapters into the ``nanovllm`` package.

The chapters under ``notebooks/`` are jupytext percent-format notebooks. Cells marked with
nbdev-style directives are written into modules under ``nanovllm/``:

``#| default_exp engine.sequence``
    once per chapter: the module that ``#| export`` cells go to by default.
``#| export`` / ``#| export sampling_params``
    the cell goes into the default module (or the named one); its public names join ``__all__``.
``#| exporti``
    the cell goes into the module but its names stay out of ``__all__`` (internal helpers).
``#| hide``
    the cell runs but is not shown on the site (the tangler ignores it otherwise).

Several chapters may export into one module: the chapter that introduces it writes its first cut, and
a later chapter *extends* it where the book tells that feature's story. A later chapter adds a method
to a class of the module, or replaces one, with d2l's idiom::

    @add_to_class(Sequence)        # from nanovllm.book.literate: in the notebook it really sets the method
    def fork(self, sample_index: int) -> Sequence:
        ...

and adds a class attribute with a plain assignment, ``Sequence.sample_index: int = 0``. The tangler
splices each such member into the one ``class`` block of the module (a replaced method keeps its place,
a new attribute goes after the class's attributes, and once every chapter is in, a new method goes right
below the first method that calls it, or last if none does, so that the class reads top-down), so the
package stays plain Python.
State that every instance needs comes the same way, without retyping the constructor::

    @add_to_init(Sequence)         # in the notebook it runs the function at the end of __init__
    def _init_forks(self) -> None:
        # which sample of its request this sequence is
        self.sample_index = 0

and the tangler appends the function's body (its comments above the ``def`` too) to the end of the
class's ``__init__`` (``__post_init__`` for a dataclass); such a function takes ``self`` alone and has no
docstring and no ``return``. A setting that a later chapter explains joins the settings dataclass as a
field: ``@add_fields(Config)`` above a small class of ``name: type = default`` lines; the tangler writes
them into the dataclass after its settings, before the fields it derives (``field(..., init=False)``).
A module-level function or constant is replaced the same way, through the module:
``import nanovllm.engine.inputs as inputs``, then ``@add_to_class(inputs)`` above the new
function or ``inputs.Prompt = ...``; the new version takes the old one's place.
Imports of ``add_to_class`` and of the module being extended (or its names) are notebook-only and dropped.
A cell's ``if TYPE_CHECKING:`` block of imports (names that only annotations need) joins one such block, below the
module's imports.

Comments in exported cells may be bilingual: ``# en: ...`` lines become plain ``# ...``
comments in the package and ``# zh: ...`` lines are left out, so the package reads in English
while each language's site shows its own lines. A docstring is written in English, with its
Chinese twin as ``# zh:`` lines right below it (tools/bilingual.py): the package keeps the
docstring and leaves the twin out like any ``# zh:`` line, and the Chinese site shows the twin in
the docstring's place (tools/book.py).

Each exported cell's code starts, in its module, with one comment line naming the chapter and the
cell's title (``# notebooks/04_scheduler.py · cell "scheduler"``): the cell to edit. Each spliced
member carries the same line, indented, above it, unless the marker just above it already names that
cell: the nearest marker above any line names the cell it came from. A comment or
docstring that only makes sense next to the chapter's prose ("see the text above", "this
chapter", "the drawing") is an error, since the package is read without the prose.

nbdev cannot read percent-format ``.py`` notebooks, which is why this small tangler exists. It
reads chapters with jupytext, so it sees exactly the cells that JupyterLab shows.

Usage::

    python tools/tangle.py            # write nanovllm/
    python tools/tangle.py --check    # exit 1 with a unified diff when nanovllm/ is stale
    python -m tools.tangle --check    # the same, as a module
"""

from __future__ import annotations

import argparse
import ast
import copy
import difflib
import functools
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "nanovllm"
DIRECTIVE = re.compile(r"^#\|\s*(?P<name>[\w-]+)\s*(?P<arg>.*?)\s*$")
MAX_LINE = 120  # ruff's line length for the package (pyproject.toml)
KNOWN_DIRECTIVES = {"default_exp", "export", "exporti", "hide"}
MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
SPLICE_HELPER = "add_to_class"
INIT_HELPER = "add_to_init"
FIELDS_HELPER = "add_fields"
SPLICE_HELPER_MODULE = "nanovllm.book.literate"
# A comment line that divides a class into sections ("# ---- blocks ----"): it belongs to no member.
SECTION_COMMENT = re.compile(r"^\s*# -{3,}")
# A cell's marker line in a generated module (see Cell.marker).
MARKER_LINE = re.compile(r"^\s*# notebooks/\S+ · cell ")
EN_COMMENT = re.compile(r"^(?P<indent>\s*)# en: ?(?P<text>.*)$")
ZH_COMMENT = re.compile(r"^\s*# zh: ?.*$")
# Phrases that point at the chapter's prose or layout, which a reader of the package does not have.
# "The kernels below" (code further down the module) is fine; "the text above" is not.
PROSE_REFERENCES = re.compile(
    r"\bthis (?:chapter|cell|notebook|section|page)\b"
    r"|\bthe chapter(?:'s)?\b(?! \d)"
    r"|\b(?:text|prose|section|table|drawing|picture|figure|diagram|rules|explanation)s? (?:above|below)\b"
    r"|\bof the (?:drawing|picture|figure|diagram)\b"
    r"|\"[^\"]+\" (?:above|below)\b",
    re.IGNORECASE,
)


class TangleError(Exception):
    """A chapter cannot be tangled; the message names the chapter file and the cell."""


@dataclass
class Cell:
    """One code cell of a chapter, with its directives split off from its code."""

    chapter: str  # path relative to the project root, e.g. "notebooks/01_sequence.py"
    index: int  # 1-based position among the chapter's cells
    title: str
    directives: dict[str, str]
    code: str

    def where(self) -> str:
        name = f'"{self.title}"' if self.title else "(untitled)"
        return f"{self.chapter}, cell {self.index} {name}"

    def marker(self) -> str:
        """The comment that opens the cell's code in its module: which cell of which chapter to edit."""
        if not self.title:
            return f"# {self.chapter} · cell {self.index}"
        start = f'# {self.chapter} · cell "'
        title = self.title if len(start) + len(self.title) < MAX_LINE else self.title[: MAX_LINE - len(start) - 2] + "…"
        return f'{start}{title}"'


@dataclass
class Module:
    """The text a module will receive, gathered from the cells that export to it."""

    name: str  # dotted, relative to the package: "engine.sequence"
    chapters: list[str]  # the chapter that introduces it, then those that extend it, in book order
    docstring: str = ""
    imports: list[str] = field(default_factory=list)
    future_imports: list[str] = field(default_factory=list)
    # The imports of the cells' ``if TYPE_CHECKING:`` blocks, gathered into one block below the imports.
    type_checking_imports: list[str] = field(default_factory=list)
    bodies: list[str] = field(default_factory=list)
    public_names: list[str] = field(default_factory=list)
    # The methods that later chapters added to each class, in chapter order (`order_added_methods` places them).
    added: dict[str, list[str]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        parts = self.name.split(".")
        if parts[-1] == "__init__":  # "#| export viz.__init__" writes the package's own module
            return Path(PACKAGE, *parts[:-1], "__init__.py")
        return Path(PACKAGE, *parts[:-1], parts[-1] + ".py")


def split_directives(source: str) -> tuple[dict[str, str], str]:
    """Separate the leading ``#|`` lines of a cell from its code."""
    directives: dict[str, str] = {}
    lines = source.splitlines()
    body_start = 0
    for i, line in enumerate(lines):
        match = DIRECTIVE.match(line)
        if match:
            directives[match["name"]] = match["arg"]
            body_start = i + 1
        elif line.strip() == "" and not directives:
            body_start = i + 1
        else:
            break
    return directives, "\n".join(lines[body_start:])


def english_comments(code: str) -> str:
    """Keep ``# en:`` comments as plain comments and drop ``# zh:`` ones."""
    kept = []
    for line in code.splitlines():
        if ZH_COMMENT.match(line):
            continue
        match = EN_COMMENT.match(line)
        kept.append(f"{match['indent']}# {match['text']}".rstrip() if match else line)
    return "\n".join(kept)


def read_cells(chapter_path: Path, root: Path) -> list[Cell]:
    chapter = chapter_path.relative_to(root).as_posix()
    try:
        notebook = read_chapter(chapter_path)
    except Exception as error:  # jupytext raises many kinds; all mean "not a chapter"
        raise TangleError(f"{chapter}: cannot be read as a percent-format notebook: {error}") from error
    cells = []
    for index, nb_cell in enumerate(notebook.cells, start=1):
        if nb_cell.cell_type != "code":
            continue
        directives, code = split_directives(nb_cell.source)
        cells.append(Cell(chapter, index, nb_cell.metadata.get("title", ""), directives, code))
    return cells


def read_chapter(chapter_path: Path) -> nbformat.NotebookNode:
    """``jupytext.read(chapter_path, fmt="py:percent")``, a copy of the parse of the file's text. The parse is most
    of a read (about 25 ms a chapter, a copy 0.4 ms), and a process may read the book several times (the test suite
    about twenty): each text is parsed once."""
    return copy.deepcopy(parsed_notebook(chapter_path.read_text(encoding="utf-8")))


@functools.lru_cache(maxsize=128)
def parsed_notebook(text: str) -> nbformat.NotebookNode:
    return jupytext.reads(text, fmt="py:percent")


def top_level_names(statements: list[ast.stmt]) -> list[str]:
    """Public names a cell defines at module level (its contribution to ``__all__``)."""
    names: list[str] = []
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [name for name in names if not name.startswith("_")]


def prose_references(code: str) -> list[tuple[int, str]]:
    """(line, phrase) of each comment or docstring in ``code`` that points at the chapter's prose.

    Other strings are left alone: a message printed into a notebook may well say "this chapter".
    """
    found = []
    statement_start = True  # a string that starts a statement is a docstring (or a bare string)
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and statement_start):
            found += [(token.start[0], match[0]) for match in PROSE_REFERENCES.finditer(token.string)]
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            statement_start = token.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    return found


def add_cell(module: Module, cell: Cell, public: bool) -> None:
    """Parse an exported cell, hoist its top-level imports, splice its class extensions, keep the rest as the body."""
    code = english_comments(cell.code)
    try:
        tree = ast.parse(code)
    except SyntaxError as error:
        raise TangleError(
            f"{cell.where()}: exported code does not parse: {error.msg} (line {error.lineno} of the cell)"
        ) from error
    references = prose_references(code)
    if references:
        line, phrase = references[0]
        raise TangleError(
            f"{cell.where()}: line {line} of the cell says {phrase!r}, which points at the chapter's prose; "
            "the package is read without it: name the chapter (\"chapter 04\") or say it in the comment"
        )
    lines = code.splitlines()
    taken_lines: set[int] = set()
    spliced: list[ast.stmt] = []
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        # A module docstring must stay the module's first statement, above the hoisted imports.
        if module.docstring or module.bodies or module.imports:
            raise TangleError(f"{cell.where()}: a module docstring must be in the first cell exported to the module")
        module.docstring = "\n".join(lines[first.lineno - 1 : first.end_lineno])
        taken_lines.update(range(first.lineno - 1, first.end_lineno))
    own_module = module_aliases(tree, module)
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            taken_lines.update(range(node.lineno - 1, node.end_lineno))
            if notebook_only_import(node, module):
                continue
            statement = ast.unparse(node)
            is_future = isinstance(node, ast.ImportFrom) and node.module == "__future__"
            target = module.future_imports if is_future else module.imports
            if statement not in target:
                target.append(statement)
            continue
        if is_type_checking_imports(node):
            taken_lines.update(range(node.lineno - 1, node.end_lineno))
            for statement in map(ast.unparse, node.body):
                if statement not in module.type_checking_imports:
                    module.type_checking_imports.append(statement)
            continue
        extension = class_extension(node, cell)
        if extension is not None:
            start = leading_comments_start(lines, first_line(node) - 1, taken_lines)
            taken_lines.update(range(start, node.end_lineno))
            spliced.append(node)
            if extension[2] == "init":
                extend_init(module, cell, extension[0], lines[start : node.end_lineno], node)
            elif extension[2] == "fields":
                extend_fields(module, cell, extension[0], lines[start : node.end_lineno], node)
            elif extension[0] in own_module:
                replace_top_level(module, cell, *extension[1:], lines[start : node.end_lineno], node)
            else:
                splice(module, cell, *extension, lines[start : node.end_lineno], node)
    body = "\n".join(line for i, line in enumerate(lines) if i not in taken_lines).strip("\n")
    # What was spliced elsewhere leaves its blank lines behind: two in a row are the most PEP 8 allows.
    body = re.sub(r"\n{4,}", "\n\n\n", body)
    if body:
        module.bodies.append(f"{cell.marker()}\n{body}")
    if public:
        own = [node for node in tree.body if node not in spliced]
        module.public_names += [n for n in top_level_names(own) if n not in module.public_names]


def is_type_checking_imports(node: ast.stmt) -> bool:
    """An ``if TYPE_CHECKING:`` block of imports alone (names for annotations, which a cycle or a cost keeps from
    being imported when the code runs): the tangler gathers such blocks into one, below the module's imports."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            and not node.orelse and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body))


def notebook_only_import(node: ast.Import | ast.ImportFrom, module: Module) -> bool:
    """An import that only the notebook needs: the splice helper, or the module being exported into (its names,
    or the module itself, which ``@add_to_class(module)`` extends)."""
    own = f"{PACKAGE}.{module.name}"
    if isinstance(node, ast.Import):
        return all(alias.name == own for alias in node.names)
    return node.module in (SPLICE_HELPER_MODULE, own)


def module_aliases(tree: ast.Module, module: Module) -> set[str]:
    """The names under which a cell imports the module it exports into (``import nanovllm.x as x``)."""
    own = f"{PACKAGE}.{module.name}"
    return {alias.asname or alias.name for node in tree.body if isinstance(node, ast.Import)
            for alias in node.names if alias.name == own}


def first_line(node: ast.stmt) -> int:
    """1-based line where a statement starts, its decorators included."""
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])


def leading_comments_start(lines: list[str], start: int, taken: set[int]) -> int:
    """0-based index of the first line of the comment block directly above line ``start`` (its own comments)."""
    while start > 0 and start - 1 not in taken and lines[start - 1].lstrip().startswith("#"):
        if SECTION_COMMENT.match(lines[start - 1]):
            break
        start -= 1
    return start


def class_extension(node: ast.stmt, cell: Cell) -> tuple[str, str, str] | None:
    """(class name, member name, kind) when ``node`` extends a class; kind is "method", "attribute", "init" or
    "fields".

    ``@add_to_class(Cls)`` above a def, an assignment to ``Cls.name``, ``@add_to_init(Cls)`` above a def (lines
    for the end of ``Cls.__init__``, member name ``__init__``), or ``@add_fields(Cls)`` above a class of fields
    for the dataclass ``Cls`` (member name: that class's); anything else is ordinary code.
    """
    if isinstance(node, ast.FunctionDef) and any(_decorator_name(d) == INIT_HELPER for d in node.decorator_list):
        return init_extension(node, cell)
    if isinstance(node, ast.ClassDef) and any(_decorator_name(d) == FIELDS_HELPER for d in node.decorator_list):
        return fields_extension(node, cell)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        helpers = [d for d in node.decorator_list if isinstance(d, ast.Call) and _is_helper(d.func)]
        if not helpers:
            return None
        call = helpers[0]
        if call is not node.decorator_list[0] or len(helpers) > 1:
            raise TangleError(f"{cell.where()}: @{SPLICE_HELPER}(...) must be the outermost decorator of {node.name}")
        if len(call.args) != 1 or call.keywords or not isinstance(call.args[0], ast.Name):
            raise TangleError(f"{cell.where()}: @{SPLICE_HELPER} takes one argument, the class by its name")
        for inner in ast.walk(node):
            if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "super":
                if not inner.args:
                    raise TangleError(
                        f"{cell.where()}: {node.name} calls super() without arguments, which fails outside a class "
                        f"body in the notebook; write super({call.args[0].id}, self)"
                    )
        return call.args[0].id, node.name, "method"
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    if len(targets) == 1 and isinstance(targets[0], ast.Attribute) and isinstance(targets[0].value, ast.Name):
        if isinstance(node, ast.AnnAssign) and node.value is None:
            raise TangleError(f"{cell.where()}: a class attribute added by a later chapter needs a value")
        return targets[0].value.id, targets[0].attr, "attribute"
    return None


def init_extension(node: ast.FunctionDef, cell: Cell) -> tuple[str, str, str]:
    """Check an ``@add_to_init(Cls)`` function, whose body the package reads as the last lines of ``Cls.__init__``."""
    where = f"{cell.where()}: @{INIT_HELPER} function {node.name}"
    call = node.decorator_list[0]
    if len(node.decorator_list) != 1 or not isinstance(call, ast.Call):
        raise TangleError(f"{where} takes @{INIT_HELPER}(Cls) as its only decorator")
    if len(call.args) != 1 or call.keywords or not isinstance(call.args[0], ast.Name):
        raise TangleError(f"{where}: @{INIT_HELPER} takes one argument, the class by its name")
    arguments = node.args
    if [a.arg for a in arguments.args] != ["self"] or arguments.posonlyargs or arguments.kwonlyargs \
            or arguments.vararg or arguments.kwarg:
        raise TangleError(f"{where} must take self alone: its body runs at the end of __init__")
    if _is_docstring(node.body[0]):
        raise TangleError(f"{where} has a docstring, which __init__ cannot hold in its middle: make it a comment")
    for inner in _own_statements(node.body):
        if isinstance(inner, (ast.Return, ast.Yield, ast.YieldFrom)):
            raise TangleError(f"{where} returns or yields, which would end __init__ early in the package")
    return call.args[0].id, "__init__", "init"


def fields_extension(node: ast.ClassDef, cell: Cell) -> tuple[str, str, str]:
    """Check an ``@add_fields(Cls)`` class, whose annotated fields the package reads as fields of the dataclass."""
    where = f"{cell.where()}: @{FIELDS_HELPER} class {node.name}"
    call = node.decorator_list[0]
    if len(node.decorator_list) != 1 or not isinstance(call, ast.Call) or len(call.args) != 1 or call.keywords \
            or not isinstance(call.args[0], ast.Name):
        raise TangleError(f"{where} takes @{FIELDS_HELPER}(Cls), the dataclass by its name, as its only decorator")
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and statement.value is not None):
            raise TangleError(f"{where} may hold only fields with a default (`name: type = value`), one a line; "
                              "say what they are in comments")
    return call.args[0].id, node.name, "fields"


def _own_statements(nodes: list[ast.AST]) -> Iterator[ast.AST]:
    """Every node under ``nodes``, without going into nested functions, lambdas and classes (their returns and
    yields are their own)."""
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        yield from _own_statements(list(ast.iter_child_nodes(node)))


def _is_helper(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == SPLICE_HELPER) or (
        isinstance(func, ast.Attribute) and func.attr == SPLICE_HELPER
    )


def member_text(source: list[str], node: ast.stmt, kind: str, indent: str) -> list[str]:
    """The member as it reads inside the class: the helper decorator dropped, ``Cls.name`` as ``name``."""
    text = textwrap.dedent("\n".join(source)).splitlines()
    if kind == "method":
        # Drop the helper decorator's lines (the outermost decorator; it may span lines).
        decorator = node.decorator_list[0]
        offset = len(source) - (node.end_lineno - first_line(node) + 1)  # comment lines above the statement
        drop = range(offset + decorator.lineno - first_line(node), offset + decorator.end_lineno - first_line(node) + 1)
        text = [line for i, line in enumerate(text) if i not in drop]
    else:
        offset = len(source) - (node.end_lineno - node.lineno + 1)
        statement = text[offset]
        name = node.targets[0] if isinstance(node, ast.Assign) else node.target
        prefix = f"{name.value.id}.{name.attr}"
        assert statement.startswith(prefix), statement
        text[offset] = statement[len(prefix.split(".")[0]) + 1 :]
    return [f"{indent}{line}" if line.strip() else "" for line in text]


def splice(module: Module, cell: Cell, class_name: str, member: str, kind: str, source: list[str],
           node: ast.stmt) -> None:
    """Put one member into the module's ``class class_name`` block: in place of its namesake, else at its spot."""
    index, cls = class_to_extend(module, cell, class_name)
    body = module.bodies[index]
    if kind == "attribute" and _is_dataclass(cls):
        raise TangleError(
            f"{cell.where()}: {class_name} is a dataclass: a later chapter adds its field {member!r} with "
            f"@{FIELDS_HELPER}({class_name}) above a class of fields (the notebook must rebuild the dataclass)"
        )
    lines = body.splitlines()
    indent = " " * cls.body[0].col_offset
    new = [f"{indent}{cell.marker()}", *member_text(source, node, kind, indent)]
    namesakes = [n for n in cls.body if _member_name(n) == member]
    if len(namesakes) > 1:
        raise TangleError(f"{cell.where()}: class {class_name} defines {member!r} more than once; cannot replace it")
    # The class's own cell, named again above what follows an inserted member (its lines are that cell's).
    own_marker = f"{indent}{lines[0].strip()}"
    if namesakes:
        old = namesakes[0]
        if (kind == "method") != isinstance(old, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise TangleError(f"{cell.where()}: {class_name}.{member} is replaced by a member of another kind")
        start = first_line(old) - 1
        start = leading_comments_start(lines, start, set())
        lines[start : old.end_lineno] = new
        remark_class_lines(lines, start + len(new), own_marker)
    elif kind == "attribute":
        # After the class's last attribute (or its docstring); a class of methods only gets it on top.
        attributes = [n for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))]
        anchor = attributes[-1] if attributes else cls.body[0] if _is_docstring(cls.body[0]) else None
        if anchor is not None:
            lines[anchor.end_lineno : anchor.end_lineno] = new if attributes else ["", *new]
            remark_class_lines(lines, anchor.end_lineno + len(new) + (0 if attributes else 1), own_marker)
        else:
            at = leading_comments_start(lines, first_line(cls.body[0]) - 1, set())
            lines[at:at] = [*new, ""]
            remark_class_lines(lines, at + len(new) + 1, own_marker)
    else:
        # At the end for now; `order_added_methods` moves it below its first caller once every chapter is in.
        lines[cls.end_lineno : cls.end_lineno] = ["", *new]
        module.added.setdefault(class_name, []).append(member)
        # What follows the class in its cell is that cell's again, not the new member's.
        remark_class_lines(lines, cls.end_lineno + len(new) + 1, lines[0])
    module.bodies[index] = "\n".join(lines)


def order_added_methods(module: Module) -> None:
    """Let each class read top-down: every method that a later chapter added goes right below the first method
    that calls it (its callees below it in turn, in the order it calls them), the first cut's members and the
    replaced ones staying where they are; a method that nothing calls stays at the end, in chapter order."""
    for class_name, added in module.added.items():
        index, cls = find_class(module, class_name)
        module.bodies[index] = "\n".join(ordered_class_lines(module.bodies[index], cls, set(added)))


def ordered_class_lines(body: str, cls: ast.ClassDef, movable: set[str]) -> list[str]:
    """The lines of ``body`` with the ``movable`` methods of ``cls`` placed as `order_added_methods` says."""
    lines = list(enumerate(body.splitlines()))
    texts = [text for _, text in lines]
    methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    blocks = {name: (leading_comments_start(texts, first_line(method) - 1, set()), method.end_lineno)
              for name, method in methods.items() if name in movable}
    placed: set[str] = set()

    def below(name: str) -> list[tuple[int, str]]:
        """The blocks to write below method ``name``: its movable callees, each followed by its own."""
        out: list[tuple[int, str]] = []
        for callee in _callees(methods[name], cls.name):
            if callee in blocks and callee not in placed:
                placed.add(callee)
                out += [(-1, ""), *lines[slice(*blocks[callee])], *below(callee)]
        return out

    insertions = {method.end_lineno - 1: below(name) for name, method in methods.items() if name not in blocks}
    # What no kept method calls goes last: first those that no other such method calls either, each with its own.
    unplaced = [name for name in blocks if name not in placed]
    called = {callee for name in unplaced for callee in _callees(methods[name], cls.name) if callee != name}
    leftovers: list[tuple[int, str]] = []
    for name in [*(n for n in unplaced if n not in called), *unplaced]:
        if name not in placed:
            placed.add(name)
            leftovers += [(-1, ""), *lines[slice(*blocks[name])], *below(name)]
    # Each block goes with the blank line above it.
    removed = {i for start, end in blocks.values() for i in range(start - (not texts[start - 1].strip()), end)}
    last_kept = max(i for i in range(cls.lineno - 1, cls.end_lineno) if i not in removed)
    insertions[last_kept] = insertions.get(last_kept, []) + leftovers
    ordered: list[tuple[int, str]] = []
    for i, line in lines:
        if i not in removed:
            ordered += [(i, line), *insertions.get(i, [])]
    return remark_after_moves(lines, ordered, cls)


def _callees(method: ast.AST, class_name: str) -> list[str]:
    """The names ``method`` reaches as ``self.name`` (or ``cls.name``, ``ClassName.name``), in the order it first
    writes them."""
    uses = sorted((n.lineno, n.col_offset, n.attr) for n in ast.walk(method) if isinstance(n, ast.Attribute)
                  and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls", class_name))
    return list(dict.fromkeys(name for *_, name in uses))


def _provenance(lines: list[tuple[int, str]]) -> dict[int, str]:
    """For each code line (by its first index), the nearest marker above it: the cell it is said to come from."""
    marker, found = "", {}
    for i, line in lines:
        if MARKER_LINE.match(line):
            marker = line.strip()
        elif line.strip() and not line.lstrip().startswith("#"):
            found[i] = marker
    return found


def remark_after_moves(before: list[tuple[int, str]], after: list[tuple[int, str]], cls: ast.ClassDef) -> list[str]:
    """Put a member's cell marker back above it where, once methods moved, the nearest marker above it is another
    cell's; then check that every line still names the cell it came from."""
    wanted = _provenance(before)
    indent = " " * cls.body[0].col_offset
    fixed: list[tuple[int, str]] = []
    marker = ""
    for i, line in after:
        if MARKER_LINE.match(line):
            marker = line.strip()
        elif i in wanted and wanted[i] != marker and line.startswith(indent) and not line[len(indent)].isspace():
            start = len(fixed)
            while start > 0 and fixed[start - 1][1].strip().startswith(("#", "@")):
                start -= 1
            fixed.insert(start, (-1, f"{indent}{wanted[i]}"))
            marker = wanted[i]
        fixed.append((i, line))
    if _provenance(fixed) != wanted:
        raise TangleError(f"ordering the methods of {cls.name} changed which cell a line is said to come from")
    return [line for _, line in fixed]


def extend_init(module: Module, cell: Cell, class_name: str, source: list[str], node: ast.FunctionDef) -> None:
    """Append the body of an ``@add_to_init`` function (with the comments above its ``def``) to the end of the
    module's ``class_name.__init__``, under the cell's marker."""
    index, cls = class_to_extend(module, cell, class_name)
    # A dataclass's __init__ is generated: the notebook's helper adds to __post_init__, and so does the package.
    target = "__post_init__" if _is_dataclass(cls) else "__init__"
    inits = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == target]
    if not inits:
        raise TangleError(f"{cell.where()}: class {class_name} has no {target} of its own to add lines to")
    init = inits[0]
    shared = _local_names(init) & _local_names(node, reads=True)
    if shared:
        raise TangleError(
            f"{cell.where()}: {node.name} uses {', '.join(sorted(shared))}, which {class_name}.{target} names too: "
            f"spliced into {target} it would read {target}'s; rename it"
        )
    lines = module.bodies[index].splitlines()
    indent = " " * init.body[0].col_offset
    offset = len(source) - (node.end_lineno - first_line(node) + 1)  # comment lines above the decorator
    comments = textwrap.dedent("\n".join(source[:offset])).splitlines() if offset else []
    body_start = offset + node.body[0].lineno - first_line(node)
    body_start = leading_comments_start(source, body_start, set(range(offset + node.lineno - first_line(node) + 1)))
    body = textwrap.dedent("\n".join(source[body_start:])).splitlines()
    new = [f"{indent}{cell.marker()}", *(f"{indent}{line}" if line.strip() else "" for line in [*comments, *body])]
    lines[init.end_lineno : init.end_lineno] = new
    own_marker = f"{' ' * cls.body[0].col_offset}{lines[0].strip()}"
    remark_class_lines(lines, init.end_lineno + len(new), own_marker)
    module.bodies[index] = "\n".join(lines)


def extend_fields(module: Module, cell: Cell, class_name: str, source: list[str], node: ast.ClassDef) -> None:
    """Write the fields of an ``@add_fields`` class (with their comments) into the dataclass ``class_name``: after its
    settings, before the fields it derives (``field(..., init=False)``), as the notebook's rebuild orders them."""
    index, cls = class_to_extend(module, cell, class_name)
    if not _is_dataclass(cls):
        raise TangleError(f"{cell.where()}: @{FIELDS_HELPER} adds fields to a dataclass; {class_name} is not one")
    lines = module.bodies[index].splitlines()
    fields = [n for n in cls.body if isinstance(n, ast.AnnAssign)]
    derived = [n for n in fields if _is_derived_field(n)]
    if derived:
        at = leading_comments_start(lines, first_line(derived[0]) - 1, set())
    else:
        at = fields[-1].end_lineno if fields else cls.body[0].end_lineno
    offset = len(source) - (node.end_lineno - first_line(node) + 1)  # comment lines above the decorator
    class_line = offset + node.lineno - first_line(node)
    body = textwrap.dedent("\n".join(source[class_line + 1 :])).splitlines()
    comments = textwrap.dedent("\n".join(source[:offset])).splitlines() if offset else []
    indent = " " * cls.body[0].col_offset
    new = [f"{indent}{cell.marker()}", *(f"{indent}{line}" if line.strip() else "" for line in [*comments, *body])]
    lines[at:at] = new
    remark_class_lines(lines, at + len(new), f"{indent}{lines[0].strip()}")
    module.bodies[index] = "\n".join(lines)


def _is_derived_field(node: ast.AnnAssign) -> bool:
    """``name: type = field(..., init=False)``: a field the dataclass derives, not a setting."""
    value = node.value
    return isinstance(value, ast.Call) and _decorator_name(value) == "field" and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in value.keywords)


def _local_names(function: ast.FunctionDef, reads: bool = False) -> set[str]:
    """A function's parameters (``self`` aside) and the names its body binds; with ``reads``, those it reads too."""
    arguments = function.args
    params = [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]]
    params += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
    names = {n.id for statement in function.body for n in ast.walk(statement)
             if isinstance(n, ast.Name) and (reads or not isinstance(n.ctx, ast.Load))}
    return (names | set(params)) - {"self"}


def remark_class_lines(lines: list[str], at: int, marker: str) -> None:
    """After a member spliced in before line ``at``: when the class goes on with a member of its own (no marker
    above it), name the class's cell above that member again, so that the nearest marker above still says where
    each line came from (`drop_repeated_markers` removes it where it repeats the one before)."""
    following = at
    while following < len(lines) and not lines[following].strip():
        following += 1
    indent = marker[: len(marker) - len(marker.lstrip())]
    continues = following < len(lines) and lines[following].startswith(indent) and lines[following].strip()
    if continues and not MARKER_LINE.match(lines[following]):
        lines[following:following] = [marker]


def replace_top_level(module: Module, cell: Cell, name: str, kind: str, source: list[str], node: ast.stmt) -> None:
    """A later chapter's version of a module-level function (``@add_to_class(module)``) or constant
    (``module.NAME = value``) takes the place of the earlier one."""
    found = find_top_level(module, name)
    if found is None:
        raise TangleError(
            f"{cell.where()}: replaces {name}, which no earlier cell exports to {PACKAGE}.{module.name} "
            "(something new needs no decorator or module prefix)"
        )
    index, old = found
    body = module.bodies[index]
    old_kind = "method" if isinstance(old, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
        "attribute" if isinstance(old, (ast.Assign, ast.AnnAssign)) else "class"
    if old_kind != kind:
        raise TangleError(f"{cell.where()}: {name} in {PACKAGE}.{module.name} is replaced by a member of another kind")
    lines = body.splitlines()
    marker, code = lines[0], lines[1:]  # every body opens with its cell's marker
    start = leading_comments_start(code, first_line(old) - 2, set())
    before = "\n".join(code[:start]).strip("\n")
    after = "\n".join(code[old.end_lineno - 1 :]).strip("\n")
    new = f"{cell.marker()}\n" + "\n".join(member_text(source, node, kind, ""))
    pieces = [f"{marker}\n{before}" if before else None, new, f"{marker}\n{after}" if after else None]
    module.bodies[index : index + 1] = [piece for piece in pieces if piece]


def find_top_level(module: Module, name: str) -> tuple[int, ast.stmt] | None:
    """(index in ``module.bodies``, the statement) of the module-level definition of ``name``."""
    for index, body in enumerate(module.bodies):
        for node in ast.parse(body).body:
            if _member_name(node) == name:
                return index, node
    return None


def find_class(module: Module, name: str) -> tuple[int, ast.ClassDef] | None:
    """(index in ``module.bodies``, the class statement) of the module's top-level class ``name``."""
    for index, body in enumerate(module.bodies):
        for node in ast.parse(body).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return index, node
    return None


def class_to_extend(module: Module, cell: Cell, class_name: str) -> tuple[int, ast.ClassDef]:
    """`find_class`, or the error that ``cell`` extends a class no earlier cell exports to ``module``."""
    found = find_class(module, class_name)
    if found is None:
        raise TangleError(
            f"{cell.where()}: extends class {class_name}, which no earlier cell exports to {PACKAGE}.{module.name}"
        )
    return found


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any(_decorator_name(d) == "dataclass" for d in cls.decorator_list)


def _member_name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
        node.target if isinstance(node, ast.AnnAssign) else None
    return target.id if isinstance(target, ast.Name) else None


def _decorator_name(node: ast.expr) -> str:
    func = node.func if isinstance(node, ast.Call) else node
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def import_group(statement: str) -> tuple[int, str]:
    """Sort key: standard library, then third-party, then this package (isort's groups)."""
    words = statement.split()
    top = words[1].split(".")[0]
    if top == PACKAGE or top == "":
        group = 2
    elif top in sys.stdlib_module_names:
        group = 0
    else:
        group = 1
    return group, statement.startswith("from "), statement.lower()


def merged_imports(statements: list[str]) -> list[str]:
    """One ``from m import a, b`` per module, as isort writes it: names merged and ordered by type, an aliased
    name on a line of its own, a statement longer than a line wrapped one name per line."""
    names: dict[tuple[str, int], list[str]] = {}  # (module, level) -> names, in the order first seen
    kept: list[str] = []
    for statement in statements:
        node = ast.parse(statement).body[0]
        if isinstance(node, ast.ImportFrom) and not any(alias.asname for alias in node.names):
            listed = names.setdefault((node.module or "", node.level), [])
            listed += [alias.name for alias in node.names if alias.name not in listed]
        else:
            kept.append(statement)
    for (module_name, level), listed in names.items():
        head = f"from {'.' * level}{module_name} import "
        ordered = sorted(listed, key=all_order)
        line = head + ", ".join(ordered)
        kept.append(line if len(line) <= MAX_LINE else head + "(\n" + "".join(f"    {n},\n" for n in ordered) + ")")
    return kept


def all_order(name: str) -> tuple[int, str]:
    """Order of ``__all__``: CONSTANTS, then Classes, then functions (ruff's RUF022 order)."""
    kind = 0 if name.isupper() else 1 if name[0].isupper() else 2
    return kind, name


def render_header(chapters: list[str]) -> str:
    """The DO-NOT-EDIT header: the chapter that introduces the module, and those that extend it."""
    if len(chapters) == 1:
        return f"# AUTOGENERATED from {chapters[0]} — edit the notebook, not this file.\n"
    later = chapters[1:]
    extended_by = ", ".join(later[:-1]) + f" and {later[-1]}" if len(later) > 1 else later[0]
    text = (f"AUTOGENERATED from {chapters[0]}, extended by {extended_by} — edit the notebooks (each cell's "
            "marker names one), not this file.")
    lines = textwrap.wrap(text, width=MAX_LINE - 2, break_long_words=False, break_on_hyphens=False)
    return "".join(f"# {line}\n" for line in lines)


def names_used(bodies: list[str]) -> set[str]:
    """Every name the module's code reads: names, the roots of attributes, and names inside string annotations."""
    used: set[str] = set()
    for body in bodies:
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                try:
                    used.update(n.id for n in ast.walk(ast.parse(node.value, mode="eval")) if isinstance(n, ast.Name))
                except SyntaxError:
                    pass
    return used


def needed_imports(statements: list[str], used: set[str], public: list[str]) -> list[str]:
    """The imports whose names the module still uses (or exports). A later chapter that replaces a member may leave
    an import that only the replaced version needed: it goes, as ruff would ask."""
    kept = []
    for statement in statements:
        node = ast.parse(statement).body[0]
        aliases = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used or a.asname in public
                   or a.name in public]
        if len(aliases) == len(node.names):
            kept.append(statement)
        elif aliases:
            node.names = aliases
            kept.append(ast.unparse(node))
    return kept


def import_groups(imports: list[str]) -> list[str]:
    """Import statements merged and sorted as isort sorts them, one text per group (standard library, third party,
    the package), to be joined by a blank line."""
    groups: dict[int, list[str]] = {}
    for statement in sorted(merged_imports(imports), key=import_group):
        groups.setdefault(import_group(statement)[0], []).append(statement)
    return ["\n".join(group) for _, group in sorted(groups.items())]


def render(module: Module) -> str:
    header = render_header(module.chapters)
    blocks: list[str] = [module.docstring] if module.docstring else []
    if module.future_imports:
        blocks.append("\n".join(sorted(module.future_imports)))
    used = names_used(module.bodies)
    type_checking = needed_imports(module.type_checking_imports, used, [])
    imports = needed_imports(module.imports, used | ({"TYPE_CHECKING"} if type_checking else set()),
                             module.public_names)
    blocks += import_groups(imports)
    if type_checking:
        blocks.append("if TYPE_CHECKING:\n" + textwrap.indent("\n\n".join(import_groups(type_checking)), "    "))
    if module.public_names:
        names = "".join(f'    "{name}",\n' for name in sorted(module.public_names, key=all_order))
        blocks.append(f"__all__ = [\n{names}]")
    text = header + "\n" + "\n\n".join(blocks)
    if module.bodies:
        # isort's rule (ruff I001): two blank lines after the imports before a def or class, one otherwise.
        first = ast.parse(module.bodies[0]).body[0]
        definition = isinstance(first, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        gap = "" if not blocks else "\n\n\n" if module.public_names or definition else "\n\n"
        text += gap + "\n\n\n".join(module.bodies)
    return drop_repeated_markers(text.rstrip("\n") + "\n")


def drop_repeated_markers(text: str) -> str:
    """One marker per run of lines from one cell: a marker line that repeats the last marker above it (the lines
    between came from that same cell) is left out; the nearest marker above a line still names its cell."""
    kept, last = [], None
    for line in text.splitlines(keepends=True):
        if MARKER_LINE.match(line):
            if line.strip() == last:
                continue
            last = line.strip()
        kept.append(line)
    return "".join(kept)


def chapter_files(root: Path) -> list[Path]:
    """The chapters, in book order (their file names start with the chapter number)."""
    return sorted(p for p in (root / "notebooks").glob("*.py") if not p.name.startswith("_"))


def exported_cells(root: Path) -> Iterator[tuple[Cell, str, bool]]:
    """Every exported cell of the book, in book order: (cell, target module, whether its names are public)."""
    for chapter_path in chapter_files(root):
        default: str | None = None
        for cell in read_cells(chapter_path, root):
            unknown = set(cell.directives) - KNOWN_DIRECTIVES
            if unknown:
                raise TangleError(f"{cell.where()}: unknown directive '#| {sorted(unknown)[0]}'")
            if "default_exp" in cell.directives:
                if default is not None:
                    raise TangleError(f"{cell.where()}: a second '#| default_exp' (the first was {default})")
                default = cell.directives["default_exp"]
                if not MODULE_NAME.match(default):
                    raise TangleError(f"{cell.where()}: '#| default_exp' needs a dotted module name, got {default!r}")
            kinds = [k for k in ("export", "exporti") if k in cell.directives]
            if not kinds:
                continue
            if len(kinds) == 2:
                raise TangleError(f"{cell.where()}: a cell is either '#| export' or '#| exporti', not both")
            target = cell.directives[kinds[0]] or default
            if target is None:
                raise TangleError(f"{cell.where()}: '#| {kinds[0]}' comes before the chapter's '#| default_exp'")
            if not MODULE_NAME.match(target):
                raise TangleError(f"{cell.where()}: '#| {kinds[0]}' needs a dotted module name, got {target!r}")
            yield cell, target, kinds[0] == "export"


def tangle(root: Path) -> dict[Path, str]:
    """Return ``{path relative to the project root: module text}`` for every chapter."""
    modules: dict[str, Module] = {}
    for cell, target, public in exported_cells(root):
        module = modules.setdefault(target, Module(target, [cell.chapter]))
        add_cell(module, cell, public=public)
        # A cell that extends the module (or only replaces in it) names its chapter in the header too.
        if cell.chapter not in module.chapters:
            module.chapters.append(cell.chapter)
    for module in modules.values():
        order_added_methods(module)
    files = {module.path: render(module) for module in modules.values()}
    # Every package directory needs an __init__.py; generate the ones no chapter owns.
    for path in list(files):
        for parent in path.parents:
            if parent == Path(".") or parent == Path(PACKAGE).parent:
                break
            init = parent / "__init__.py"
            files.setdefault(init, f"# AUTOGENERATED by tools/tangle.py — package marker for {parent.as_posix()}.\n")
    return dict(sorted(files.items()))


def existing_files(root: Path) -> dict[Path, str]:
    package = root / PACKAGE
    if not package.exists():
        return {}
    return {
        path.relative_to(root): path.read_text(encoding="utf-8")
        for path in sorted(package.rglob("*"))
        # JupyterLab's checkpoints of a package file opened in it are not part of the package.
        if path.is_file() and "__pycache__" not in path.parts and ".ipynb_checkpoints" not in path.parts
    }


def diff(expected: dict[Path, str], actual: dict[Path, str]) -> str:
    """Unified diff from what is on disk to what the notebooks produce."""
    chunks = []
    for path in sorted(set(expected) | set(actual)):
        old, new = actual.get(path), expected.get(path)
        if old == new:
            continue
        chunks += difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            (new or "").splitlines(keepends=True),
            fromfile=f"{path} (on disk)" if old is not None else "/dev/null",
            tofile=f"{path} (from notebooks)" if new is not None else "/dev/null (no chapter produces it)",
        )
    return "".join(chunks)


def write(root: Path, expected: dict[Path, str]) -> list[Path]:
    """Make ``nanovllm/`` exactly what the notebooks produce; return the paths that changed."""
    actual = existing_files(root)
    changed = []
    for path in sorted(set(actual) - set(expected)):
        (root / path).unlink()
        changed.append(path)
    for path, text in expected.items():
        if actual.get(path) != text:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail with a diff if nanovllm/ is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="project root (default: this checkout)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        expected = tangle(root)
    except TangleError as error:
        print(f"tangle: error: {error}", file=sys.stderr)
        return 2
    if args.check:
        difference = diff(expected, existing_files(root))
        if difference:
            sys.stdout.write(difference)
            print(f"\ntangle: {PACKAGE}/ differs from the notebooks; run tools/tangle.py", file=sys.stderr)
            return 1
        print(f"tangle: {PACKAGE}/ matches the notebooks ({len(expected)} files)")
        return 0
    changed = write(root, expected)
    for path in changed:
        print(f"tangle: wrote {path}")
    print(f"tangle: {len(expected)} files, {len(changed)} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
