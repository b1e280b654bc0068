"""Installing the project is quiet (setuptools reads pyproject.toml without a deprecation warning), and what it
installs runs the server without the book's extras.

``./dev`` installs the project with ``pip install -e ".[dev]"``, which builds it with the newest
setuptools that ``[build-system]`` allows. A license written as a TOML table (``{ text = "MIT" }``)
made that print a screen of ``SetuptoolsDeprecationWarning``; the SPDX expression (PEP 639) does not,
and needs setuptools 77 or newer.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
FIRST_SETUPTOOLS_WITH_SPDX_LICENSES = Version("77.0.0")


def test_the_license_is_an_spdx_expression() -> None:
    assert PYPROJECT["project"]["license"] == "MIT"


def test_the_build_requires_a_setuptools_that_reads_spdx_licenses() -> None:
    (setuptools,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    older = Version(f"{FIRST_SETUPTOOLS_WITH_SPDX_LICENSES.major - 1}.99")
    assert not setuptools.specifier.contains(older)
    assert setuptools.specifier.contains(FIRST_SETUPTOOLS_WITH_SPDX_LICENSES)


def test_building_the_metadata_prints_no_warning(tmp_path: Path) -> None:
    """What pip does first when it installs the project: setuptools' PEP 517 metadata hook, on a copy."""
    setuptools = pytest.importorskip("setuptools")
    if Version(setuptools.__version__) < FIRST_SETUPTOOLS_WITH_SPDX_LICENSES:
        pytest.skip(f"setuptools {setuptools.__version__} here; pip builds with the one [build-system] asks for")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "nanovllm").mkdir()
    (tmp_path / "nanovllm" / "__init__.py").write_text("")
    (tmp_path / "out").mkdir()
    build = subprocess.run(
        [sys.executable, "-W", "default", "-c",
         "from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel('out'))"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert build.returncode == 0, build.stderr
    assert "Warning" not in build.stderr and "deprecated" not in build.stderr.lower(), build.stderr
    metadata = (tmp_path / "out" / build.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: MIT" in metadata


# What only the book's extras (`.[dev]`) install: the engine and its server must not need them.
BOOK_ONLY_MODULES = ("IPython", "ipywidgets", "ipykernel", "jupytext", "nbformat", "nbclient", "openai", "pytest",
                     "hypothesis")


def test_the_server_imports_nothing_that_only_the_books_extras_install() -> None:
    """`python -m nanovllm.serve` runs where only the project's own dependencies are installed: importing its command
    line (which imports the app, its live page and the visualization it draws with) imports none of the extras."""
    code = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.partition('.')[0] in {BOOK_ONLY_MODULES!r}:\n"
        "            raise ModuleNotFoundError(f'{name} (only the book extras install it)')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "import nanovllm.serve.cli, nanovllm.llm\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
