"""mkdocs hooks: keep pages free of requests to other hosts when they are viewed.

mkdocs-jupyter's page template always carries a small module script that would import
mermaid.js from a CDN if a notebook contained a mermaid diagram. The book has none and must
load nothing from the internet, so the script is removed from every page.
"""

from __future__ import annotations

import re

NOT_SCRIPT_END = r"(?:(?!</script>).)*"
CDN_MODULE_SCRIPT = re.compile(rf'<script type="module">{NOT_SCRIPT_END}https://cdnjs\.{NOT_SCRIPT_END}</script>', re.S)


def on_post_page(output: str, page: object, config: object) -> str:
    return CDN_MODULE_SCRIPT.sub("", output)
