"""Chinese reads without stray spaces: wrapped lines join, bold labels close without a space.

Markdown turns the line break inside a paragraph into a space, which is right between English
words and wrong between Chinese characters: a chapter whose Chinese source wraps at 100 columns
renders as "发生了 什么" and "写入时， 先得到". Browsers do not apply the CSS Text Level 3 rule
that would drop those breaks, so the sources are fixed before they are rendered: ``tidy_cjk``
joins each wrapped line of a paragraph to the one before it when the break falls between two
wide characters (East Asian Width F, W or H, not Hangul: the rule of CSS Text Level 3 and of
markdown-it-cjk-breaks) or next to wide punctuation ("，", "。", "（"), which never takes a space.

The other stray space is written on purpose: ``**目标：** 读完本章`` needs it, because CommonMark
does not close ``**`` between punctuation and a letter (``**目标：**读完`` shows its asterisks).
``tidy_cjk`` moves the punctuation out of the emphasis instead, ``**目标**：读完本章``, which
closes and needs no space. Spaces typed around emphasis inside Chinese text (``之上 *调度* 的``)
go too, where CommonMark still reads the emphasis without them (``*`` next to a letter, not to
punctuation; ``_`` never: it does not open or close between two letters).

Paragraphs are found with markdown-it-py (jupytext's own Markdown parser), so code blocks,
tables, headings and hard line breaks are left as they are. The site (tools/book.py's
``localize`` and the landing pages) and the JupyterLab reading copies (tools/lab.py, through
``localize``) both use it.
"""

from __future__ import annotations

import re
import unicodedata

from markdown_it import MarkdownIt

PARSER = MarkdownIt("commonmark").enable("table")
CONTAINER_PREFIX = re.compile(r"^[ \t>]*")  # a continuation line's indentation and blockquote marks
EMPHASIS = "*_~"  # markup around a word: "**块表**" ends with "表" as far as the reader sees
# Emphasis followed by one space and more text: **inner** next. Whether it is a bold label that ends in
# wide punctuation before Chinese text is decided by label_without_space.
EMPHASIS_THEN_SPACE = re.compile(r"(?P<mark>\*\*?)(?P<inner>[^*\s][^*\n]*?)(?P=mark) (?P<next>\S)")
SPACE_BEFORE_EMPHASIS = re.compile(r"(?P<before>[^\s*]) (?P<mark>\*\*?)(?P<after>[^\s*])")
SPACE_AFTER_EMPHASIS = re.compile(r"(?P<before>[^\s*])(?P<mark>\*\*?) (?P<after>[^\s*])")


def is_hangul(char: str) -> bool:
    return "HANGUL" in unicodedata.name(char, "")


def is_wide(char: str) -> bool:
    return unicodedata.east_asian_width(char) in "FWH" and not is_hangul(char)


def is_wide_punctuation(char: str) -> bool:
    return is_wide(char) and unicodedata.category(char).startswith("P")


def break_disappears(before: str, after: str) -> bool:
    """Whether a line break between these two characters renders as nothing (else as a space)."""
    if is_wide_punctuation(before) or is_wide_punctuation(after):
        return True
    return is_wide(before) and is_wide(after)


def is_hard_break(line: str) -> bool:
    return line.endswith("  ") or line.rstrip(" ").endswith("\\")


def joins(line: str, continuation: str) -> bool:
    left, right = line.rstrip().rstrip(EMPHASIS), continuation.lstrip(EMPHASIS)
    return bool(left and right) and not is_hard_break(line) and break_disappears(left[-1], right[0])


def label_without_space(match: re.Match) -> str:
    """``**目标：** 读`` as ``**目标**：读``; any other emphasis and space as it was."""
    inner = match["inner"]  # only stops, commas and colons move out: a closing bracket stays with its opening one
    label = inner.rstrip("".join(c for c in inner if is_wide(c) and unicodedata.category(c) == "Po"))
    if label == inner or not label or not is_wide(match["next"]):
        return match[0]
    return f"{match['mark']}{label}{match['mark']}{inner[len(label):]}{match['next']}"


def is_letter(char: str) -> bool:
    return is_wide(char) and not is_wide_punctuation(char)


def space_before_emphasis(match: re.Match) -> str:
    """``之上 *调度`` as ``之上*调度`` (an opening ``*`` before a letter opens after anything)."""
    if is_wide(match["before"]) and is_letter(match["after"]):
        return f"{match['before']}{match['mark']}{match['after']}"
    return match[0]


def space_after_emphasis(match: re.Match) -> str:
    """``处理* 的`` as ``处理*的`` (a closing ``*`` after a letter closes before anything)."""
    if is_letter(match["before"]) and is_wide(match["after"]):
        return f"{match['before']}{match['mark']}{match['after']}"
    return match[0]


def tidy_line(line: str) -> str:
    line = EMPHASIS_THEN_SPACE.sub(label_without_space, line)
    line = SPACE_BEFORE_EMPHASIS.sub(space_before_emphasis, line)
    return SPACE_AFTER_EMPHASIS.sub(space_after_emphasis, line)


def tidy_cjk(markdown: str) -> str:
    """``markdown`` without the spaces its paragraphs would show between Chinese characters."""
    if not any(is_wide(c) for c in markdown):
        return markdown
    lines = markdown.split("\n")
    glued = [False] * len(lines)  # glued[i]: line i continues line i - 1 with no space
    for token in PARSER.parse(markdown):
        if token.type != "paragraph_open" or token.map is None:
            continue
        start, end = token.map
        for i in range(start, min(end, len(lines))):
            lines[i] = tidy_line(lines[i])
        for i in range(start + 1, min(end, len(lines))):
            glued[i] = joins(lines[i - 1], CONTAINER_PREFIX.sub("", lines[i]))
    out: list[str] = []
    for line, glue in zip(lines, glued, strict=True):
        if glue:
            out[-1] = out[-1].rstrip() + CONTAINER_PREFIX.sub("", line)
        else:
            out.append(line)
    return "\n".join(out)
