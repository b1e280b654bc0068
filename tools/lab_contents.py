"""The contents manager ``./dev lab`` gives JupyterLab: jupytext's, plus the kernel's ``language_info`` on chapters.

Why a class of our own. JupyterLab's notebook model fills in a ``language_info`` that a notebook lacks
(``NotebookModel._ensureMetadata``, with ``{"name": ""}``), just after it has marked the freshly loaded
notebook unmodified; then the kernel, once started, replaces it with its own. Each of these changes
marks the tab unsaved, with no edit, and autosave then writes the file. A chapter
(``notebooks/NN_topic.py``) never carries ``language_info`` (its jupytext header keeps only the kernel
spec; a Python version in the header would change with every machine), and neither JupyterLab nor
jupytext has a setting to supply it. So the chapters are served as jupytext serves them, with the
``language_info`` the kernel will report added (the same one the reading copies carry: tools/lab.py's
``LANGUAGE_INFO``): both changes then set what is already there, and the tab stays clean. On save,
jupytext's default metadata filter leaves ``language_info`` out of the text file, so a chapter saved
without an edit stays byte-identical.

The class derives from ``jupytext.AsyncTextFileContentsManager``, which is what jupytext's own server
extension would build from Jupyter Server's default manager; being a jupytext manager already, that
extension leaves it in place.
"""

from __future__ import annotations

from jupytext import AsyncTextFileContentsManager

from tools.lab import LANGUAGE_INFO


class ChapterContentsManager(AsyncTextFileContentsManager):
    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if content and model.get("type") == "notebook" and not path.endswith(".ipynb"):
            model["content"].metadata.setdefault("language_info", dict(LANGUAGE_INFO))
        return model
