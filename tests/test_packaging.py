"""Installing the project is quiet: setuptools reads pyproject.toml without a deprecation warning.

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

ROOT = Path(__file__).resolve().parent.parent
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
