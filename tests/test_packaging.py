"""What a non-editable install ships: every data file the package reads at run time."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_data_file_under_sluice_is_declared_as_package_data():
    """A file under sluice/ that is not Python (a kernel's source, the simulator's step
    profiles) reaches an installed package only through [tool.setuptools.package-data]."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    data = [p for p in (ROOT / "sluice").rglob("*") if p.is_file() and p.suffix not in
            (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data, "no data files found: the test would check nothing"
    undeclared = []
    for path in data:
        rel = path.relative_to(ROOT)
        shipped = any(
            str(rel.parent).replace("/", ".").startswith(package)
            and fnmatch.fnmatch(str(rel.relative_to(Path(*package.split(".")))), pattern)
            for package, patterns in declared.items() for pattern in patterns)
        if not shipped:
            undeclared.append(str(rel))
    assert undeclared == []
