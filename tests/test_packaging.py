"""What a distribution ships besides code: the license pyproject names."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_license_file_is_the_apache_2_text_pyproject_names() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    # An SPDX expression (PEP 639): setuptools >= 77 warns on every install (`make
    # run` too) that a `{text = ...}` table is deprecated.
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in pyproject["build-system"]["requires"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    # The full text (its nine sections and the appendix), not a stub pointing elsewhere.
    assert "9. Accepting Warranty or Additional Liability." in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    assert "END OF TERMS AND CONDITIONS" in text
