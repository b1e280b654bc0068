# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown] tags=["en"]
# # D · How the book is built: extensions, printed phrases, tangling
#
# **Goal.** See the tools behind the chapters, not the engine: how a later chapter extends a class
# that an earlier one built (`add_to_class`, `add_to_init`, `add_fields`), how a chapter prints in
# the reader's language (`Phrases`), how the chapters become the `nanovllm` package (the tangler),
# and how the book checks itself: the three parts and the short road, the chapters executed in
# both languages, the reading copies. The helpers of the first two sections are the book's only
# package code outside the engine that the core chapters use, which is why this appendix belongs
# to the core part.

# %% [markdown] tags=["zh"]
# # D · 本书是怎样构建的：扩展、打印的短语、抽取
#
# **目标：** 看看各章背后的工具，而不是引擎：后面的章节如何扩展前面某章构建的类（`add_to_class`、`add_to_init`、
# `add_fields`），一章如何用读者的语言打印（`Phrases`），各章如何变成 `nanovllm` 包（抽取工具），以及本书如何检查
# 自己：三个部分与最短路径、用两种语言执行的各章、阅读副本。前两节的辅助工具是核心各章用到的、引擎之外仅有的包代码，
# 所以这个附录属于核心部分。

# %% this appendix's phrases
#| hide
# en: What this appendix prints, in Chinese for the Chinese site (nanovllm.book.lang, built below).
# zh: 本附录打印的文字及其中文，中文网站打印中文（nanovllm.book.lang，在本附录后面构建）。
from nanovllm.book.lang import Phrases

say = Phrases({
    "{title}: chapters {numbers}": "{title}：{numbers}",
    "{card}, {date}: {command} -> {figures}": "{card}，{date}：{command} -> {figures}",
    "refused: {refusal}": "拒绝：{refusal}",
})

# %% [markdown] tags=["en"]
# ## First cuts and extensions
#
# Each engine module is introduced by one chapter as a **first cut**: the shape of nano-vllm's
# file, so that you can lay the chapter next to upstream's source and match it class by class.
# A later chapter that tells a feature's story **extends** what is already there: chapter 05
# gives `Sequence` a `fork` method, chapter 14 gives the model runner its CUDA graphs, chapter 18
# makes the scheduler asynchronous. The tool is d2l's `add_to_class`: a decorator that sets a
# function as a method of a class that already exists.
#
# In a notebook the decorator really changes the class, for the rest of the session: edit an
# extension cell, run it again, and the engine uses your version. In the package, which
# `tools/tangle.py` writes from the chapters, nothing is patched at run time: the tangler moves
# each extension into the one `class` block where it belongs, with a comment naming the chapter
# and cell it came from, so the package reads as plain Python. A replaced method keeps its place;
# the chapter that replaced it is the one to edit. A new method goes right below the first method
# that calls it, so that a class reads from the top down, whichever chapter wrote each part.

# %% [markdown] tags=["zh"]
# ## 初版与扩展
#
# 引擎的每个模块都由一章先给出**初版**：形状与 nano-vllm 的同名文件一致，你可以把这一章和上游源码并排对照，
# 逐个类地找到对应。后面讲某个特性的那一章再**扩展**已有的代码：第 05 章给 `Sequence` 加上 `fork` 方法，
# 第 14 章给模型执行器加上 CUDA Graph，第 18 章让调度器异步起来。用的工具是 d2l 的 `add_to_class`：
# 一个装饰器，把函数设为一个已有类的方法。
#
# 在 notebook 里，这个装饰器会真正改变那个类，并在整个会话中生效：修改一个扩展单元、重新运行它，引擎就会用上你的版本。
# 而在由 `tools/tangle.py` 从各章生成的包里，运行时什么也不打补丁：抽取工具把每个扩展移到它所属的那个唯一的
# `class` 块里，并附上一行注释，写明它来自哪一章的哪个单元，所以包读起来就是普通的 Python。被替换的方法留在原位；
# 要修改它，就去改替换它的那一章。新加的方法紧跟在第一个调用它的方法下面，所以不管各部分出自哪一章，一个类都能
# 从上往下读。

# %% add to class
#| export book.literate
"""The book's literate helpers: a later chapter adds a method to a class that an earlier chapter built, lines to
the end of its constructor, or fields to a dataclass."""
# zh: 本书的文学编程辅助工具：后面的章节给前面章节构建的类添加方法、在它的构造函数末尾添加几行，
# zh: 或者给 dataclass 添加字段。

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any


def add_to_class(cls: type) -> Callable[[Any], Any]:
    """Decorator: make the decorated function (or property, staticmethod, ...) a member of ``cls``, under its name.

    The notebook's way of extending a class (d2l's ``add_to_class``). The package never calls it: the tangler
    splices the same member into the class's own ``class`` block.
    """
    # zh: 装饰器：把被装饰的函数（或者 property、staticmethod……）以它的名字变成 ``cls`` 的成员。
    # zh:
    # zh: 这是 notebook 扩展一个类的方式（d2l 的 ``add_to_class``）。包从不调用它：抽取工具把同一个成员
    # zh: 拼接进这个类自己的 ``class`` 块。

    def add(member: Any) -> Any:
        setattr(cls, _member_name(member), member)
        return member

    return add


def _member_name(member: Any) -> str:
    # en: A property has no name of its own; its getter has. A staticmethod or classmethod wraps a function.
    # zh: property 自己没有名字，它的 getter 有；staticmethod 和 classmethod 包着一个函数。
    for candidate in (member, getattr(member, "fget", None), getattr(member, "__func__", None)):
        name = getattr(candidate, "__name__", None)
        if isinstance(name, str):
            return name
    raise TypeError(f"add_to_class needs a named member (a function, property, ...), got {member!r}")


def add_to_init(cls: type) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Decorator: run the decorated function, which takes ``self`` alone, at the end of ``cls.__init__`` (of
    ``__post_init__`` for a dataclass, whose ``__init__`` is generated).

    A later chapter's way of giving every instance the state its feature needs without retyping the constructor.
    In the package the tangler appends the function's body to ``__init__`` (or ``__post_init__``) itself, so the
    extension is written as those lines: no docstring (a comment says what it adds), no return.
    """
    # zh: 装饰器：在 ``cls.__init__`` 的末尾（dataclass 则是 ``__post_init__``，因为它的 ``__init__`` 是生成的）
    # zh: 运行被装饰的函数，这个函数只接受 ``self``。
    # zh:
    # zh: 这是后面的章节给每个实例加上它的特性所需的状态、而不必重写构造函数的方式。在包里，抽取工具把函数体本身
    # zh: 追加到 ``__init__``（或 ``__post_init__``）中，所以这个扩展就按那几行来写：没有文档字符串（用一条注释说明它
    # zh: 加了什么），没有 return。

    def add(extension: Callable[[Any], None]) -> Callable[[Any], None]:
        name = "__post_init__" if dataclasses.is_dataclass(cls) else "__init__"
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            extension(self)

        setattr(cls, name, wrapper)
        return extension

    return add


def add_fields(cls: type) -> Callable[[type], type]:
    """Decorator on a class of annotated fields, each with a default: make them fields of the dataclass ``cls``,
    after its own settings (before the fields it derives, ``init=False``), as if they had been written there.

    The notebook rebuilds ``cls``'s generated methods so that ``cls(...)`` takes the new fields (a frozen dataclass
    stays frozen); the package never calls it: the tangler writes the fields into the dataclass's own ``class``
    block.
    """
    # zh: 装饰一个由带注解、各有默认值的字段组成的类：把它们变成 dataclass ``cls`` 的字段，放在它自己的设置之后
    # zh: （在它推导出的字段，即 ``init=False`` 的字段之前），就像它们原本就写在那里一样。
    # zh:
    # zh: notebook 会重建 ``cls`` 生成的方法，让 ``cls(...)`` 接受新字段（frozen 的 dataclass 重建后仍是 frozen）；
    # zh: 包从不调用它：抽取工具把这些字段写进这个 dataclass 自己的 ``class`` 块。

    def add(holder: type) -> type:
        params = cls.__dataclass_params__
        if params.order or params.unsafe_hash:
            raise TypeError(f"add_fields rebuilds plain and frozen dataclasses only; {cls.__name__} is ordered or "
                            "hashed")
        new = inspect.get_annotations(holder)
        missing = [name for name in new if name not in holder.__dict__]
        if missing:
            raise TypeError(f"add_fields: every added field needs a default, {', '.join(missing)} has none")
        old = dataclasses.fields(cls)
        derived = [f for f in old if not f.init]
        settings = [f for f in old if f.init]
        annotations = {f.name: cls.__annotations__[f.name] for f in settings} | new
        annotations |= {f.name: cls.__annotations__[f.name] for f in derived}
        # en: Field objects carry each old field's default and options (init, repr) back into the rebuild.
        # zh: Field 对象把每个旧字段的默认值和选项（init、repr）带回重建后的类。
        for f in old:
            setattr(cls, f.name, f)
        for name in new:
            setattr(cls, name, holder.__dict__[name])
        methods = ["__init__", "__repr__", "__eq__", "__hash__", "__match_args__", "__dataclass_fields__",
                   "__dataclass_params__"]
        # en: A frozen dataclass's __setattr__ and __delattr__ are generated too.
        # zh: frozen 的 dataclass 的 __setattr__ 和 __delattr__ 也是生成的。
        for generated in methods + ["__setattr__", "__delattr__"] * params.frozen:
            if generated in cls.__dict__:
                delattr(cls, generated)
        cls.__annotations__ = annotations
        dataclasses.dataclass(cls, eq=params.eq, frozen=params.frozen)
        return holder

    return add

# %% [markdown] tags=["en"]
# A toy first: a class, then a later cell that replaces one method and adds a property.

# %% [markdown] tags=["zh"]
# 先看一个玩具例子：一个类，然后在后面的单元里替换它的一个方法、再加一个 property。

# %%
from nanovllm.book.literate import add_to_class


class Tally:
    def __init__(self) -> None:
        self.count = 0

    def add(self, n: int) -> None:
        self.count += n


# en: Built before the extension: it gets the new members too.
# zh: 在扩展之前就已创建：它同样能用上新加的成员。
tally = Tally()


@add_to_class(Tally)
def add(self, n: int) -> None:
    """Never count below zero."""
    # zh: 计数永远不会低于零。
    self.count = max(0, self.count + n)


@add_to_class(Tally)
@property
def empty(self) -> bool:
    return self.count == 0


tally.add(2)
tally.add(-5)
print(tally.count, tally.empty)
assert (tally.count, tally.empty) == (0, True)

# %% [markdown] tags=["en"]
# A feature often needs state of its own in every instance as well: a list, a lock, a counter. Retyping
# the whole constructor to add two lines would hide what changed, so the second helper, `add_to_init`,
# appends lines to it instead: the decorated function takes `self` alone and runs at the end of
# `__init__`. In the package the tangler writes its body at the end of the constructor, which is why the
# function has no docstring and no `return`: a comment says what the lines add.

# %% [markdown] tags=["zh"]
# 一个特性往往还需要每个实例各有一份自己的状态：一个列表、一把锁、一个计数器。为了加两行而重写整个构造函数，会把改了
# 什么藏起来，所以第二个辅助工具 `add_to_init` 改为在构造函数末尾追加几行：被装饰的函数只接受 `self`，在
# `__init__` 结束时运行。在包里，抽取工具把它的函数体写到构造函数的末尾，所以这个函数没有 docstring，也没有
# `return`：用一行注释说明这几行加了什么。

# %%
from nanovllm.book.literate import add_to_init


@add_to_init(Tally)
def _init_history(self) -> None:
    # en: Every amount added, in order.
    # zh: 加过的每个数，按顺序记下。
    self.history: list[int] = []


@add_to_class(Tally)
def add(self, n: int) -> None:
    """Never count below zero; remember every amount."""
    # zh: 计数永远不会低于零；记下每一笔数量。
    self.history.append(n)
    self.count = max(0, self.count + n)


fresh = Tally()
fresh.add(3)
fresh.add(-1)
print(fresh.count, fresh.history, Tally.__init__.__name__)
assert (fresh.count, fresh.history, Tally.__init__.__name__) == (2, [3, -1], "__init__")

# %% [markdown] tags=["en"]
# Settings arrive the same way. The engine's settings are one dataclass, and a setting belongs to the
# chapter that explains it, so a later chapter adds fields to it with `add_fields`: a small class of
# annotated fields, each with its default, becomes part of the dataclass (after its settings, before
# the fields it derives), and `add_to_init` on a dataclass appends to its `__post_init__`, where a
# setting is checked. In the package the fields are written into the dataclass itself.

# %% [markdown] tags=["zh"]
# 设置也这样加进来。引擎的设置是一个 dataclass，而每个设置属于讲解它的那一章，所以后面的章节用 `add_fields` 给它
# 加字段：一个只有带默认值的注解字段的小类，会成为这个 dataclass 的一部分（排在它的设置之后、派生字段之前）；对
# dataclass 使用 `add_to_init`，则是追加到它的 `__post_init__` 末尾，设置就在那里检查。在包里，这些字段直接写在
# dataclass 自己的定义里。

# %%
from dataclasses import dataclass, field, fields

from nanovllm.book.literate import add_fields


@dataclass
class Knobs:
    size: int = 1
    # en: derived, not a setting
    # zh: 派生出来的，不是设置
    area: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.area = self.size * self.size


@add_fields(Knobs)
class _Depth:
    depth: int = 2


@add_to_init(Knobs)
def _check_depth(self) -> None:
    if self.depth < 1:
        raise ValueError(f"depth must be >= 1, got {self.depth}")


knobs = Knobs(3, depth=4)
print(knobs)
assert (knobs.size, knobs.depth, knobs.area) == (3, 4, 9)
assert [f.name for f in fields(Knobs)] == ["size", "depth", "area"]
try:
    Knobs(depth=0)
except ValueError as error:
    print(error)
else:
    raise AssertionError("depth=0 was accepted")

# %% [markdown] tags=["en"]
# The book's other helper speaks your language. The traces and tables that chapters print are part of
# the lesson, so they are printed in the reader's language: the English stays in the code, and each
# chapter keeps the Chinese of what it prints in one hidden table of phrases. `say` looks a phrase up and
# fills in its values; `NANOVLLM_BOOK_LANG=zh` (which the Chinese site's build and the Chinese reading
# copies set) makes it speak Chinese. Numbers, identifiers and code stay as they are.

# %% [markdown] tags=["zh"]
# 本书的另一个辅助工具会说你的语言。各章打印的轨迹和表格是课程的一部分，所以按读者的语言打印：英文留在代码里，
# 每一章把它所打印文字的中文放在一张隐藏的短语表里。`say` 查出一句短语并填入其中的值；设置
# `NANOVLLM_BOOK_LANG=zh`（中文网站的构建和中文阅读副本都会设置）后，它就说中文。数字、标识符和代码保持原样。

# %% printed phrases
#| export book.lang
"""What the book prints, in the reader's language: English by default, Chinese when NANOVLLM_BOOK_LANG=zh.

A chapter's traces and tables are part of its lesson. Its code keeps the English (the key), and one
``Phrases`` table per chapter holds the Chinese of what it prints. Numbers, identifiers and code are
printed as they are: only the words around them are translated.
"""
# zh: 本书打印的内容，用读者的语言：默认是英文，NANOVLLM_BOOK_LANG=zh 时是中文。
# zh:
# zh: 一章的轨迹和表格是它课程的一部分。它的代码保留英文（作为键），每章一个 ``Phrases`` 表，存放它所打印内容的
# zh: 中文。数字、标识符和代码原样打印：只翻译它们周围的文字。

import os
import re
import string
import unicodedata

LANG_ENV = "NANOVLLM_BOOK_LANG"
LANGUAGES = ("en", "zh")
# en: A width in a format spec, with its optional fill and alignment: "<22", ">4", "*^9", "12".
# zh: 格式说明里的宽度，可带填充字符和对齐方式："<22"、">4"、"*^9"、"12"。
_WIDTH_SPEC = re.compile(r"(?P<align>.?[<>^])?(?P<width>\d+)")


def reading_language() -> str:
    """The language the book prints in: ``NANOVLLM_BOOK_LANG`` ("en" or "zh"), English when it is unset."""
    # zh: 本书打印所用的语言：``NANOVLLM_BOOK_LANG``（"en" 或 "zh"），未设置时为英文。
    lang = os.environ.get(LANG_ENV) or "en"
    if lang not in LANGUAGES:
        raise ValueError(f"{LANG_ENV} must be one of {LANGUAGES}, got {lang!r}")
    return lang


def display_width(text: str) -> int:
    """Columns ``text`` takes in a monospaced font: a Chinese character (or full-width punctuation) takes two."""
    # zh: ``text`` 在等宽字体中占多少列：一个汉字（或全角标点）占两列。
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


class Text(str):
    """Printed text that pads by display width, so that a Chinese heading keeps its table's columns aligned."""
    # zh: 按显示宽度填充的打印文字，让中文表头也能保持表格各列对齐。

    def __format__(self, spec: str) -> str:
        match = _WIDTH_SPEC.fullmatch(spec)
        if match is None:
            return format(str(self), spec)
        width = max(int(match["width"]) - (display_width(self) - len(self)), 0)
        return format(str(self), f"{match['align'] or ''}{width}")


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


class Phrases:
    """One chapter's printed phrases: the English templates, as the code reads them, and their Chinese.

    ``say = Phrases({"free list: {free}": <its Chinese, with the same {free}>})``; then
    ``say("free list: {free}", free=[3, 4])`` is ``free list: [3, 4]`` in English and the Chinese template,
    filled with the same list, when the book reads in Chinese. A template missing from the table is an
    error in both languages, so that an English run already finds a phrase without its Chinese.
    """
    # zh: 一章要打印的短语：英文模板（代码里读到的样子），以及它们的中文。
    # zh:
    # zh: ``say = Phrases({"free list: {free}": <它的中文，带同样的 {free}>})``；然后
    # zh: ``say("free list: {free}", free=[3, 4])`` 在英文中是 ``free list: [3, 4]``，本书以中文阅读时则是
    # zh: 填入同一个列表的中文模板。表中缺少的模板在两种语言下都是错误，这样英文运行就已经能发现缺少中文的短语。

    def __init__(self, zh: dict[str, str]) -> None:
        for en, text in zh.items():
            if _fields(en) != _fields(text):
                raise ValueError(f"{text!r} must fill the fields of {en!r}: {sorted(_fields(en))}")
        self.zh = dict(zh)

    def __call__(self, template: str, /, **values: object) -> Text:
        """``template`` (English) in the reading language, its ``{fields}`` filled with ``values``."""
        # zh: 把 ``template``（英文）换成阅读语言，并用 ``values`` 填充它的 ``{fields}``。
        if template not in self.zh:
            raise KeyError(f"no Chinese for the phrase {template!r}: add it to its chapter's Phrases table")
        chosen = self.zh[template] if reading_language() == "zh" else template
        return Text(chosen.format(**values))

# %% [markdown] tags=["en"]
# ## From chapters to the package: the tangler
#
# `python -m tools.tangle` reads every chapter with jupytext (so it sees exactly the cells that
# JupyterLab shows) and writes the cells marked `#| export` into modules under `nanovllm/`:
# `#| default_exp engine.sequence` names a chapter's module once, `#| export other.module` sends one
# cell elsewhere, `#| exporti` keeps a cell's names out of `__all__`, and `#| hide` keeps a cell's
# code off the site. The directives are nbdev's, so nbdev users feel at home; nbdev itself does
# not read percent-format `.py` notebooks, hence this small tangler. Each module starts with a
# header naming its chapters, and each cell's code with a *marker*, a comment naming the chapter
# and the cell to edit. The `# en:` lines of a comment become the package's comments, the `# zh:`
# lines stay in the notebook, and so does a docstring's Chinese twin (`# zh:` lines right below it,
# which the Chinese site shows in the docstring's place). `python -m tools.tangle --check` (which
# CI runs) fails with a diff whenever `nanovllm/` differs from what the chapters give: the package
# is never edited by hand.
#
# Below, a book of two small chapters, tangled: the first builds a class, the second adds a
# method to it, and the package reads as one `class` block.

# %% [markdown] tags=["zh"]
# ## 从各章到包：抽取工具
#
# `python -m tools.tangle` 用 jupytext 读取每一章（所以它看到的单元与 JupyterLab 显示的完全一样），把标记了
# `#| export` 的单元写进 `nanovllm/` 下的模块：`#| default_exp engine.sequence` 为一章指定一次它的模块，
# `#| export other.module` 把一个单元送到别处，`#| exporti` 让单元里的名字不进 `__all__`，`#| hide` 让单元的代码不出现
# 在网站上。这些指令沿用 nbdev 的写法，nbdev 用户会觉得眼熟；nbdev 本身读不了 percent 格式的 `.py` notebook，所以
# 才有这个小小的抽取工具。每个模块开头有一段说明它来自哪些章的文件头，每个单元的代码前有一行*标记*：一条注释，写明
# 要修改的是哪一章的哪个单元。注释中的 `# en:` 行成为包里的注释，`# zh:` 行只留在 notebook 里；文档字符串的中文版本
# （紧跟在它下面的 `# zh:` 行，中文网站把它显示在文档字符串的位置上）也是如此。只要 `nanovllm/` 与
# 各章生成的结果不同，`python -m tools.tangle --check`（CI 会运行它）就会失败并给出差异：包从不手工修改。
#
# 下面是一本只有两章的小书，抽取之后：第一章构建一个类，第二章给它加一个方法，包里读到的是一个完整的 `class` 块。

# %%
import sys
import tempfile
import textwrap
from pathlib import Path

# en: The project's root, where tools/ lives: this appendix may run from a reading copy in read/en/ or read/zh/.
# zh: 项目的根目录，tools/ 就在那里：这个附录可能从 read/en/ 或 read/zh/ 下的阅读副本里运行。
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "tools" / "tangle.py").is_file())
sys.path.insert(0, str(ROOT))
from tools.tangle import tangle

first = """
    # %%
    #| default_exp engine.counter

    # %% counter
    #| export
    class Counter:
        \"\"\"Counts up.\"\"\"

        def __init__(self) -> None:
            self.count = 0
"""
second = """
    # %% counting
    #| export engine.counter
    from nanovllm.book.literate import add_to_class
    from nanovllm.engine.counter import Counter


    @add_to_class(Counter)
    def add(self, n: int) -> None:
        # never below zero
        self.count = max(0, self.count + n)
"""
toy = Path(tempfile.mkdtemp(prefix="nanovllm-appendix-d-"))
(toy / "notebooks").mkdir()
(toy / "notebooks" / "01_first.py").write_text(textwrap.dedent(first), encoding="utf-8")
(toy / "notebooks" / "02_second.py").write_text(textwrap.dedent(second), encoding="utf-8")
package = tangle(toy)
module = package[Path("nanovllm/engine/counter.py")]
print(module)

# %%
assert "class Counter:" in module and module.count("class Counter") == 1
assert '# notebooks/02_second.py · cell "counting"' in module and "    def add(self, n: int) -> None:" in module
assert "# never below zero" in module
assert "add_to_class" not in module
namespace: dict = {}
exec(compile(module, "counter.py", "exec"), namespace)
counter = namespace["Counter"]()
counter.add(2)
counter.add(-5)
assert counter.count == 0

# %% [markdown] tags=["en"]
# The tangler refuses what would read badly in the package: an extension of a class no earlier
# cell exports, a `super()` without arguments (it fails in a notebook cell outside the class), a
# comment that points at the chapter's prose ("see the text above": the package is read without
# it), a second `default_exp`. `python -m tools.first_cuts` prints, per module, the first cut's
# code lines next to upstream nano-vllm's and what each later chapter adds, then the members a
# later chapter replaces whole and the *hooks*: a method of a first cut that does nothing, returns
# its argument or a constant, or refuses, so that a later chapter can fill it instead of retyping
# the method. Both are costs: a retyped method hides what changed, and a hook names a concept the
# reader meets only later. The tests keep both in view; the code is judged by reading it.

# %% [markdown] tags=["zh"]
# 抽取工具会拒绝那些在包里读起来别扭的东西：扩展一个之前没有任何单元导出的类；不带参数的 `super()`（在类外的
# notebook 单元里它会失败）；指向本章正文的注释（“见上文”：读包的人看不到正文）；第二个 `default_exp`。
# `python -m tools.first_cuts` 按模块打印初版的代码行数（与上游 nano-vllm 对照）以及后面每一章加了多少，然后列出被
# 后面章节整个替换的成员，以及*钩子*：初版里什么也不做、原样返回参数或一个常量、或者直接拒绝的方法，让后面的章节
# 填上它，而不必重写整个方法。两者都是代价：重写的方法掩盖了改动，钩子提到了读者后来才遇到的概念。测试盯着这两者；
# 代码好不好，要靠读它来判断。

# %% [markdown] tags=["en"]
# ## Three parts, and the short road
#
# The book has three parts, listed in `tools/parts.py` and shown by the sites' navigation and
# `python -m tools.book parts`: *core* (chapters 00–10, with appendix A's player and this
# appendix's helpers), *speed* (11–19) and *beyond* (20–28, with appendix C's live page). The core
# part alone must build the engine: `tests/core_road.py` copies the checkout, deletes every chapter
# outside the core part and every generated module, tangles what is left, and checks that the
# package imports, that greedy decoding gives `transformers`' tokens under chunked prefill,
# prefix-cache hits and preemption, that every core chapter executes, and that the core engine
# stays within about 2,600 lines of code.

# %% [markdown] tags=["zh"]
# ## 三个部分，以及最短的路
#
# 本书分三个部分，列在 `tools/parts.py` 里，网站的导航和 `python -m tools.book parts` 都按它显示：*核心*（第 00–10 章，
# 加上附录 A 的播放器和本附录的辅助工具）、*速度*（第 11–19 章）和*更远*（第 20–28 章，加上附录 C 的实时页面）。
# 只靠核心部分就必须能构建出引擎：`tests/core_road.py` 复制一份代码，删掉核心部分以外的所有章节和所有生成的模块，
# 抽取剩下的部分，然后检查：包能导入；在分块 prefill、前缀缓存命中和抢占之下，贪心解码给出与 `transformers` 相同的
# token；每个核心章节都能执行；核心引擎的代码不超过大约 2,600 行。

# %%
from nanovllm.book.lang import reading_language
from tools.parts import PARTS, TITLES, part_of

for part, chapters in PARTS.items():
    numbers = " ".join(chapter.split("_")[0] for chapter in chapters)
    print(say("{title}: chapters {numbers}", title=TITLES[reading_language()][part], numbers=numbers))
assert part_of("10_engine") == "core" and part_of("D_the_book") == "core"
# en: Every chapter here belongs to a part (part_of raises KeyError for one that does not).
# zh: 这里的每一章都属于某个部分（不属于任何部分的章节，part_of 会抛出 KeyError）。
assert all(part_of(path.stem) for path in (ROOT / "notebooks").glob("*.py"))

# %% [markdown] tags=["en"]
# ## Figures from a GPU, recorded
#
# This machine has no GPU, and CI runs on one like it, so a chapter cannot measure a GPU while it
# executes. What a GPU measured is recorded instead, in one JSON file per chapter under
# `notebooks/data/recorded/`: each run with the card it ran on, the date and the command that
# printed the figures, then the figures. `recorded(chapter)` loads a chapter's runs and refuses a
# run without a card, an ISO date or a command. A chapter prints its figures from there and
# asserts on them, and every GPU figure its prose quotes is either in those figures or asserted
# by a cell (`tests/book/test_recorded.py` checks both). Running the command on a GPU measures
# them again.

# %% [markdown] tags=["zh"]
# ## 记录下来的 GPU 数字
#
# 这台机器没有 GPU，CI 用的也是这样的机器，所以一章在执行时没法测量 GPU。GPU 上测得的东西改为记录下来，每章一个
# JSON 文件，放在 `notebooks/data/recorded/` 下：每次运行写明它用的卡、日期和打印这些数字的命令，然后是数字本身。
# `recorded(chapter)` 载入一章的各次运行，缺少卡、ISO 格式的日期或命令的运行会被拒绝。一章从那里打印它的数字并对它们
# 做断言；正文引用的每个 GPU 数字，要么在这些数字里，要么由某个单元断言（`tests/book/test_recorded.py` 检查这两点）。
# 在 GPU 上运行那条命令，就能重新测量它们。

# %% recorded figures
#| export book.recorded
"""GPU figures that a chapter records: one JSON file per chapter, each run with its card, date and command."""
# zh: 章节记录下的 GPU 数字：每章一个 JSON 文件，每次运行都带着它的卡、日期和命令。

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nanovllm

# en: In the repository, beside the chapters: the figures are the book's, not the engine's.
# zh: 在仓库里，紧挨着各章：这些数字属于书，不属于引擎。
RECORDED = Path(nanovllm.__file__).resolve().parents[1] / "notebooks" / "data" / "recorded"


@dataclass(frozen=True)
class Run:
    """One recorded run: the card it ran on, the date (ISO), the command that printed ``figures``."""
    # zh: 记录下的一次运行：它所在的卡、日期（ISO 格式）、打印出 ``figures`` 的命令。

    name: str
    card: str
    date: str
    command: str
    figures: dict[str, Any]
    note: str = ""


def recorded(chapter: str, folder: Path = RECORDED) -> dict[str, Run]:
    """The runs that ``chapter`` (a file stem, such as "14_cuda_graphs") records, by name."""
    # zh: ``chapter``（文件名主干，比如 "14_cuda_graphs"）记录的各次运行，按名字排列。
    path = folder / f"{chapter}.json"
    runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
    return {name: checked_run(name, fields, path) for name, fields in runs.items()}


def checked_run(name: str, fields: dict[str, Any], path: Path) -> Run:
    """``fields`` as a `Run`, or ValueError naming what is missing or malformed."""
    # zh: 把 ``fields`` 变成一个 `Run`；缺少或格式不对时抛出 ValueError，写明是哪一项。
    missing = [key for key in ("card", "date", "command", "figures") if not fields.get(key)]
    if missing:
        raise ValueError(f"{path.name}, run {name!r}: no {', '.join(missing)}")
    try:
        datetime.date.fromisoformat(fields["date"])
    except ValueError:
        raise ValueError(f"{path.name}, run {name!r}: date {fields['date']!r} is not YYYY-MM-DD") from None
    unknown = set(fields) - {"card", "date", "command", "figures", "note"}
    if unknown:
        raise ValueError(f"{path.name}, run {name!r}: unknown keys {sorted(unknown)}")
    return Run(name, **fields)

# %%
import tempfile

from nanovllm.book.recorded import recorded

folder = Path(tempfile.mkdtemp())
(folder / "99_example.json").write_text(json.dumps({"runs": {"decode": {
    "card": "NVIDIA H100 80GB HBM3", "date": "2026-12-06", "command": "python -m nanovllm.bench --latency",
    "figures": {"batch 1 ms": 0.928}}}}), encoding="utf-8")
example = recorded("99_example", folder)["decode"]
print(say("{card}, {date}: {command} -> {figures}", card=example.card, date=example.date, command=example.command,
          figures=example.figures))
assert example.figures["batch 1 ms"] == 0.928
# en: A run without its command is refused: a figure nobody can measure again is not a record.
# zh: 没有命令的运行会被拒绝：别人没法重新测量的数字算不上记录。
(folder / "99_example.json").write_text(json.dumps({"runs": {"decode": {
    "card": "NVIDIA H100 80GB HBM3", "date": "2026-12-06", "figures": {"batch 1 ms": 0.928}}}}), encoding="utf-8")
try:
    recorded("99_example", folder)
    refusal = ""
except ValueError as error:
    refusal = str(error)
print(say("refused: {refusal}", refusal=refusal))
assert "no command" in refusal

# %% [markdown] tags=["en"]
# ## How the chapters are checked, and read
#
# `./dev test` (which CI runs on a clean clone) checks the tangle and the bilingual pairs, runs
# ruff, then executes every chapter once per language, top to bottom in a fresh kernel (a cell
# that raises fails the run; the site shows that run's outputs), runs the core road above and the
# test suite beside them, and builds both sites with `mkdocs build --strict`, with checks on the
# built pages. On a GPU machine, `scripts/gpu-ci.sh` runs the tests marked `gpu` and every
# chapter under nbval.
#
# `./dev lab` writes one *reading copy* per chapter and language (`read/en/`, `read/zh/`): only
# that language's prose and comments, the exercise answers folded. A reader may run and annotate
# a copy; `./dev lab` rewrites it from its chapter only while the reader has not edited it. The
# chapters themselves, `notebooks/NN_topic.py`, hold both languages and are the only source.

# %% [markdown] tags=["zh"]
# ## 各章如何被检查、被阅读
#
# `./dev test`（CI 在全新克隆的代码上运行它）检查抽取结果与中英成对，运行 ruff，然后把每一章按每种语言各执行一次，
# 在全新的内核里从头到尾运行（任何单元抛出异常都会让这次运行失败；网站显示的就是这次运行的输出），在它们旁边运行上面
# 的最短路径检查和测试集，再用 `mkdocs build --strict` 构建两个网站，并检查构建出的页面。在 GPU 机器上，
# `scripts/gpu-ci.sh` 运行标记为 `gpu` 的测试，并用 nbval 运行每一章。
#
# `./dev lab` 为每一章、每种语言各写一份*阅读副本*（`read/en/`、`read/zh/`）：只有那种语言的正文和注释，练习答案折叠
# 起来。读者可以运行副本、在上面做笔记；只要读者没有改过它，`./dev lab` 就会按对应的章节重写它。各章本身，即
# `notebooks/NN_topic.py`，同时保存两种语言，是唯一的源头。

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm/book/literate.py`: `add_to_class`, `add_to_init` and `add_fields`, the notebook's way of
#   extending what an earlier chapter built; the tangler splices the same members into the package.
# - `nanovllm/book/lang.py`: `Phrases` and `reading_language`, what a chapter prints, in the reader's
#   language.
# - `nanovllm/book/recorded.py`: `recorded`, the GPU runs a chapter records, each with its card,
#   date and command.
#
# ## Exercises
#
# 1. Add a third chapter to the small book above that gives `Counter` a `reset` method. Where does
#    the tangler put it, and what does its marker say?
# 2. Which part does chapter 17 belong to, and why can the core engine run without it?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm/book/literate.py`：`add_to_class`、`add_to_init` 与 `add_fields`，notebook 里扩展前面章节所建之物的方式；
#   抽取工具把同样的成员拼接进包里。
# - `nanovllm/book/lang.py`：`Phrases` 与 `reading_language`，让一章按读者的语言打印。
# - `nanovllm/book/recorded.py`：`recorded`，一章记录的各次 GPU 运行，每次都带着卡、日期和命令。
#
# ## 练习
#
# 1. 给上面的小书加第三章，为 `Counter` 加一个 `reset` 方法。抽取工具把它放在哪里，它的标记写着什么？
# 2. 第 17 章属于哪个部分？为什么核心引擎没有它也能运行？

# %%
# en: 1: a new method goes below the first method that calls it, or last; its marker names the third chapter.
# zh: 1：新方法放在第一个调用它的方法下面，没有调用者就放在最后；它的标记写着第三章。
third = """
    # %% resetting
    #| export engine.counter
    from nanovllm.book.literate import add_to_class
    from nanovllm.engine.counter import Counter


    @add_to_class(Counter)
    def reset(self) -> None:
        self.count = 0
"""
(toy / "notebooks" / "03_third.py").write_text(textwrap.dedent(third), encoding="utf-8")
module = tangle(toy)[Path("nanovllm/engine/counter.py")]
assert module.index("def add(") < module.index("def reset(")
assert '# notebooks/03_third.py · cell "resetting"' in module
# en: 2: speed (17_tp_runtime); the core engine builds a ModelRunner in one process, and chapter 17 replaces the
# en: engine's constructor to start ranks when tensor_parallel_size > 1.
# zh: 2：速度部分（17_tp_runtime）；核心引擎在一个进程里构建 ModelRunner，第 17 章替换引擎的构造函数，在
# zh: tensor_parallel_size > 1 时启动多个 rank。
assert part_of("17_tp_runtime") == "speed"
