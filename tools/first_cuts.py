"""How big is each engine module's first cut, next to upstream nano-vllm's file?

The book builds each module in reading order: the chapter that introduces it exports a *first cut* in
the shape of upstream's file, and later chapters extend it (``tools/tangle.py``). This tool measures
that promise in code lines, the way the book's issue tracker states it: lines that hold code, not
blank lines, comments or docstrings. A module's first cut is what its introducing chapter exports to
it (notebook-only imports aside); each later chapter's extension is counted the same way; the total
is the generated module without its ``__all__``.

It also counts the two costs of extending a module in a later chapter. *Retyped* members are replaced whole
after an earlier chapter wrote them: the reader reads a second copy. *Hooks* are empty members that a first cut
plants for a later chapter to fill: the reader of the first cut meets a name that does nothing yet, and the
further ahead its filler, the longer it waits. Neither cost is free, so lowering one by raising the other is no
gain; the report prints both, side by side.

    python -m tools.first_cuts     # the tables
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools import tangle
from tools.parts import reading_position

# Code lines of upstream's files at bb823b3 (main on 2026-04-26), counted by `code_lines` below.
UPSTREAM_LINES = {
    "engine.sequence": 65,
    "engine.block_manager": 102,
    "engine.scheduler": 78,
    "engine.model_runner": 235,
    "engine.llm_engine": 81,
    "config": 22,
}
# Code lines that later chapters retype: members (or top-level names) that replace an earlier chapter's version whole.
# A guard, not a goal: never add a hook to lower it. It rose once, 145 -> 178, when the core chapters became a whole
# engine (issue 58): chapter 11 replaces the backend choice (resolve_attention_backend, attention_backend) and
# chapter 17 the rank-count check and the runner's choice (start_runner), which in the core keep to one process.
# It rose again, 178 -> 215, when hooks stopped counting as free (issue 58, item 4): chapter 12's three forward hooks
# (previous tokens, graph replay, pending tokens) became chapter 14 and 18 retyping compute_logits, which reads as one
# method per chapter, and a dead graph branch of ModelRunner.forward went away with them. Then 215 -> 301 when the
# core stopped naming the 8-bit cache: chapter 24 retypes the reference backend's store, prefill and decode, the
# layer's forward and the runner's allocation, copies and exit with their scales, where chapters 07 and 09 used to
# carry scale parameters and six hooks for it. And 301 -> 315 when speculative decoding became one object: chapter
# 25 retypes LLMEngine._launch and exit, where chapter 18's _launch used to ask two hooks seven chapters ahead (316:
# chapter 14's compute_logits refuses chapter 18's `previous`, which the package's later code passes it in a session).
# Then 316 -> 311 when chapter 18's compute_logits handed its checks to begin_step (sampling inside the graph), and
# 311 -> 355 with issue 62: chapter 17b retypes TPRunner._state (4 lines), and chapter 27 (KV events) retypes
# PrefixCache.publish and forget, the two places where hash_to_block_id changes, with the line that tells the event
# log (a hook in chapter 03 would name KV events 24 chapters early), Scheduler._notify, where a step ends and its
# batch leaves, and LLMEngine.exit, which closes the publisher. 355 -> 370 with issue 61: chapter 25b retypes
# Speculator.drafts_per_sequence, chapter 25's fixed rule (16 rows, two drafts at least) turned into the budget from
# measured step costs; the chapter compares the two, and a seam in 25 would name measured costs before the reader
# has seen why the fixed rule needs them. 370 -> 388 with issue 63: chapter 29 retypes ModelRunner.launch (18
# lines), where a step's logits become tokens: a constrained step leaves the captured sampling path and is masked
# before the sampler; no existing member sees the logits and the sequences together, and a hook in chapter 18 would
# name grammars eleven chapters early. 388 -> 408 with issue 63's server slice: chapter 29 retypes Api.generate
# (14 lines), whose one change is that the request's sampling parameters (and so its compiled constraint) are
# built on the tokenizer's thread, off the event loop: no member of chapter 22 runs after tokenizing off the
# loop; and EngineInfo.of (6 lines), which passes the engine's reason not to constrain across the pipe. 408 -> 426
# with issue 63's tool calls: chapter 29b retypes chapter 22's chat route, chat_completions (18 lines), which must
# hand the tools to the chat template and parse the reply; what it checks and renders moved to a new member
# (Api.template_messages), and the parsing is a view over the response (Api.tool_calls_of), so that the route is
# the only member written again; a hook in chapter 22 would name tools nine chapters early. 426 -> 469 with issue
# 63's speculation slice: chapter 29 retypes ModelRunner.verify (34 lines) for the two lines that mask a verify
# step's rows by the grammars (Grammars.mask_drafts), verify being the one member that sees a verify step's logits
# before its sampler, and LLMEngine._reserve_drafts (9 lines), the one member that holds a proposal before its
# slots are reserved, to cut the drafts a grammar refuses (Grammars.cut_drafts); hooks in chapter 25 would name
# grammars four chapters early. 469 -> 442: chapter 25's verify is its forward (verify_logits) then its sampling
# (sample_verify), so chapter 29 retypes verify in 7 lines instead of 34. 441 -> 454 with issue 63's
# tensor-parallel slice: chapter 29 no longer retypes EngineInfo.of (6 lines: no engine refuses to constrain now)
# and retypes RankWorker._sequences (19 lines), where rank 0 rebuilds a step's sequences, so that it keeps each
# constrained sequence's object, and with it its matcher, from step to step; a seam in chapter 17 would keep
# sequences for a feature twelve chapters away. 454 -> 479 with issue 63's grammar workers: chapter 29's launch
# hands the whole captured draw to graph_draw (17 lines, was 18), and chapter 29c retypes ModelRunner.masked_draw
# (14 lines), whose sampling it queues later (LaterTokens) so that the host's rest of a step runs beside the workers'
# fill, and ModelRunner.begin_step (11 lines), which must settle that sampling before the next step queues anything
# (its replay overwrites the hidden states the sampling reads); a seam in chapter 18 would name tokens sampled
# later eleven chapters early. 479 -> 495 with issue 63's device share: chapter 29c retypes forbid (7 lines), which
# on a GPU becomes one Triton kernel (chapter 29, at its length bound, keeps the three tensor operations that a CPU
# runs), and ModelRunner.exit (9 lines), which stops the grammar workers so that an engine that exits leaves no
# process behind; a seam in chapter 09's exit would name grammar workers twenty chapters early.
# Otherwise it only falls; each change, and why, is in `git log -p tools/first_cuts.py`.
MAX_RETYPED_LINES = 495
# Hooks that first cuts plant for later chapters (see `is_seam`). A guard like the one above: it may only fall.
MAX_HOOKS = 25
# The engine modules whose first cut must stay upstream-shaped.
BOUNDED = ("engine.sequence", "engine.block_manager", "engine.scheduler", "engine.model_runner", "engine.llm_engine")
MAX_RATIO = 1.5
SKIPPED_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                  tokenize.ENCODING, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """Lines that hold code: no blank lines, comments or docstrings (of the module, classes and functions)."""
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                first.value.value, str
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIPPED_TOKENS:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def cell_code(cell: tangle.Cell, module: str) -> str:
    """What a cell gives its module: its code in English, without the imports that only the notebook needs."""
    code = tangle.english_comments(cell.code)
    lines = code.splitlines()
    target = tangle.Module(module, [cell.chapter])
    for node in ast.parse(code).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and tangle.notebook_only_import(node, target):
            lines[node.lineno - 1 : node.end_lineno] = [""] * (node.end_lineno - node.lineno + 1)
    return "\n".join(lines)


@dataclass
class Growth:
    """One module's code lines: the first cut, then what each later chapter adds."""

    module: str
    chapters: list[str] = field(default_factory=list)
    by_chapter: dict[str, int] = field(default_factory=dict)
    total: int = 0

    @property
    def first_cut(self) -> int:
        return self.by_chapter[self.chapters[0]]


def measure(root: Path) -> dict[str, Growth]:
    """Every module's growth, from the chapters under ``root``."""
    growth: dict[str, Growth] = {}
    for cell, target, _ in tangle.exported_cells(root):
        entry = growth.setdefault(target, Growth(target))
        if cell.chapter not in entry.chapters:
            entry.chapters.append(cell.chapter)
        entry.by_chapter[cell.chapter] = entry.by_chapter.get(cell.chapter, 0) + code_lines(cell_code(cell, target))
    for path, text in tangle.tangle(root).items():
        name = ".".join(path.with_suffix("").parts[1:])
        if name in growth:
            lines = text.splitlines()
            for node in ast.parse(text).body:
                if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
                    lines[node.lineno - 1 : node.end_lineno] = [""] * (node.end_lineno - node.lineno + 1)
            growth[name].total = code_lines("\n".join(lines))
    return growth


@dataclass(frozen=True)
class Retyped:
    """A member (``Class.name``) or top-level name of ``module`` that ``chapter`` replaces whole, ``lines`` code
    lines, over the version that ``earlier`` wrote."""

    chapter: str
    module: str
    name: str
    earlier: str
    lines: int
    # the version before was a seam, which this one fills: not counted
    seam: bool = False


def defined_names(node: ast.stmt, cell: tangle.Cell, own_module: set[str]) -> list[str]:
    """What a top-level statement of an exported cell defines: ``Class.member`` for a class extension, the name
    of a function, class or assignment, and for a class its members too. ``own_module``: the names under which
    the cell imports the module it exports into (`tangle.module_aliases`)."""
    extension = tangle.class_extension(node, cell)
    if extension is not None:
        # Lines added to the end of a constructor, and fields added to a dataclass, replace nothing.
        if extension[2] in ("init", "fields"):
            return []
        # `@add_to_class(module)`, the module exported into, replaces a top-level name (as the tangler does).
        return [extension[1]] if extension[0] in own_module else [f"{extension[0]}.{extension[1]}"]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name) and t.id != "__all__"]
    if isinstance(node, ast.ClassDef):
        members = [m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        members += [t.id for m in node.body if isinstance(m, ast.Assign) for t in m.targets if isinstance(t, ast.Name)]
        members += [m.target.id for m in node.body if isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name)]
        return [node.name, *(f"{node.name}.{member}" for member in members)]
    return []


def is_seam(node: ast.stmt) -> bool:
    """A hook that a first cut leaves for a later chapter to fill: a function whose body, its docstring aside, is
    empty or one ``pass``, ``...``, bare ``yield``, ``raise`` (a hook that refuses until it is filled), or ``return``
    of nothing, of a constant (a tuple or list of constants too, ``[]`` for none) or of one of its own arguments
    unchanged (an identity hook).
    Filling it retypes nothing."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = node.body[1:] if tangle._is_docstring(node.body[0]) else node.body
    if not body:
        return True
    if len(body) != 1:
        return False
    statement = body[0]
    if isinstance(statement, (ast.Pass, ast.Raise)):
        return True
    if isinstance(statement, ast.Return):
        value = statement.value
        arguments = {argument.arg for argument in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
        return (value is None or isinstance(value, ast.Constant)
                or (isinstance(value, (ast.Tuple, ast.List))
                    and all(isinstance(item, ast.Constant) for item in value.elts))
                or (isinstance(value, ast.Name) and value.id in arguments - {"self", "cls"}))
    if isinstance(statement, ast.Expr):
        value = statement.value
        return (isinstance(value, ast.Constant) and value.value is Ellipsis) or (
            isinstance(value, ast.Yield) and value.value is None)
    return False


def retyped_members(root: Path) -> list[Retyped]:
    """Every member that a chapter replaces after an earlier chapter wrote it, in book order; a seam that a later
    chapter fills (see `is_seam`) is marked so, and does not count."""
    first: dict[tuple[str, str], str] = {}
    # Whether the latest version of each member is a seam.
    seams: dict[tuple[str, str], bool] = {}
    found: list[Retyped] = []
    for cell, target, _ in tangle.exported_cells(root):
        code = cell_code(cell, target)
        lines = code.splitlines()
        # The cell as written: cell_code drops the import of the module it extends, which names its alias.
        own_module = tangle.module_aliases(ast.parse(tangle.english_comments(cell.code)), tangle.Module(target, []))
        for node in ast.parse(code).body:
            members = [node, *getattr(node, "body", [])] if isinstance(node, ast.ClassDef) else [node]
            for name in defined_names(node, cell, own_module):
                earlier = first.setdefault((target, name), cell.chapter)
                member = node if isinstance(node, ast.ClassDef) and name == node.name else next(
                    (m for m in members if tangle._member_name(m) == name.split(".")[-1]), node)
                filled = seams.get((target, name), False)
                seams[(target, name)] = is_seam(member)
                # A class statement's own name: only when the whole class is written again.
                if earlier != cell.chapter and (not isinstance(node, ast.ClassDef) or name == node.name):
                    text = "\n".join(lines[tangle.first_line(node) - 1 : node.end_lineno])
                    found.append(Retyped(cell.chapter, target, name, earlier, code_lines(text), filled))
    return found


def retyped_report(retyped: list[Retyped]) -> str:
    """Retyped code lines by chapter, then the total against the bound."""
    by_chapter: dict[str, list[Retyped]] = {}
    for item in retyped:
        if not item.seam:
            by_chapter.setdefault(item.chapter, []).append(item)
    rows = ["retyped (a later chapter replaces the member whole):"]
    for chapter, items in by_chapter.items():
        names = ", ".join(f"{item.name} {item.lines}" for item in items)
        rows.append(f"  {_number(chapter):>4} {sum(i.lines for i in items):>4} lines: {names}")
    counted = [item for item in retyped if not item.seam]
    total = retyped_lines(retyped)
    rows.append(f"  {len(counted)} members, {total} code lines (bound {MAX_RETYPED_LINES})")
    by_module: dict[str, dict[str, int]] = {}
    for item in counted:
        chapters = by_module.setdefault(item.module, {})
        chapters[item.chapter] = chapters.get(item.chapter, 0) + item.lines
    rows.append("  by module (chapter lines):")
    rows += [f"    {module:<22}" + ", ".join(f"{_number(chapter)} {lines}" for chapter, lines in chapters.items())
             for module, chapters in by_module.items()]
    return "\n".join(rows)


def reading_order(root: Path) -> list[str]:
    """The chapters under ``root`` as `Retyped` names them, in reading order (the appendices with their parts)."""
    paths = sorted(tangle.chapter_files(root), key=lambda path: reading_position(path.stem))
    return [str(path.relative_to(root)) for path in paths]


def hooks(retyped: list[Retyped]) -> list[Retyped]:
    """The hooks that later chapters fill: each names the chapter that planted it (``earlier``) and its filler."""
    return [item for item in retyped if item.seam]


def chapters_ahead(item: Retyped, chapters: list[str]) -> int:
    """How many chapters (``chapters``: reading order) the filler of a hook comes after the one that planted it."""
    return chapters.index(item.chapter) - chapters.index(item.earlier)


def hooks_report(retyped: list[Retyped], chapters: list[str]) -> str:
    """The hooks, planted → filled, with how far ahead each filler comes; then the count against the bound."""
    planted = hooks(retyped)
    rows = ["hooks (a first cut plants an empty member for a later chapter to fill):"]
    for item in sorted(planted, key=lambda hook: (chapters.index(hook.earlier), hook.name)):
        rows.append(f"  {_number(item.earlier):>4} -> {_number(item.chapter):<4} "
                    f"{chapters_ahead(item, chapters):>2} ahead  {item.module}.{item.name}")
    far = sum(1 for item in planted if chapters_ahead(item, chapters) >= 7)
    rows.append(f"  {len(planted)} hooks, {far} of them filled seven or more chapters ahead (bound {MAX_HOOKS})")
    return "\n".join(rows)


def retyped_lines(retyped: list[Retyped]) -> int:
    """The retyped code lines that count: seams filled aside."""
    return sum(item.lines for item in retyped if not item.seam)


def report(growth: dict[str, Growth]) -> str:
    """The table: upstream, first cut and its ratio, each extension, total."""
    rows = [f"{'module':<22}{'upstream':>9}{'first cut':>10}{'ratio':>7}  {'extensions by chapter':<52}{'total':>6}"]
    for name in [*UPSTREAM_LINES, *sorted(set(growth) - set(UPSTREAM_LINES))]:
        if name not in growth:
            continue
        entry, upstream = growth[name], UPSTREAM_LINES.get(name)
        ratio = f"{entry.first_cut / upstream:.2f}" if upstream else ""
        first = f"{entry.first_cut} ({_number(entry.chapters[0])})"
        extensions = ", ".join(f"{_number(c)} +{entry.by_chapter[c]}" for c in entry.chapters[1:])
        rows.append(f"{name:<22}{upstream or '':>9}{first:>10}{ratio:>7}  {extensions:<52}{entry.total:>6}")
    return "\n".join(rows)


def _number(chapter: str) -> str:
    return Path(chapter).stem.split("_")[0]


def main() -> int:
    growth = measure(tangle.ROOT)
    print(report(growth))
    retyped = retyped_members(tangle.ROOT)
    print(retyped_report(retyped))
    print(hooks_report(retyped, reading_order(tangle.ROOT)))
    if retyped_lines(retyped) > MAX_RETYPED_LINES:
        print(f"first_cuts: more than {MAX_RETYPED_LINES} retyped code lines", file=sys.stderr)
        return 1
    if len(hooks(retyped)) > MAX_HOOKS:
        print(f"first_cuts: more than {MAX_HOOKS} hooks", file=sys.stderr)
        return 1
    over = [name for name in BOUNDED if growth[name].first_cut > MAX_RATIO * UPSTREAM_LINES[name]]
    if over:
        print(f"first_cuts: over {MAX_RATIO}x upstream: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
