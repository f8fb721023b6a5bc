"""What a non-editable install ships (every data file the package reads at run time), and
the import floors between the package's parts."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("package, forbidden", [
    ("sluice.api", {"worker", "operator", "router", "local", "autoscale", "cascade", "sim"}),
    ("sluice.router", {"worker", "operator"}),
    ("sluice.operator", {"worker", "router"}),
    ("sluice.worker", {"router", "operator"}),
])
def test_layering_each_component_imports_no_other_component(package, forbidden):
    """``sluice/api`` is the bottom floor, and the three components share only what lies
    below them: importing every module of ``package`` loads none of
    the ``forbidden`` subpackages of ``sluice``. Each in a fresh interpreter."""
    code = ("import importlib, pkgutil, sys\n"
            f"package = importlib.import_module({package!r})\n"
            "for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
            "    importlib.import_module(module.name)\n"
            "print(' '.join(sorted({n.split('.')[1] for n in sys.modules"
            " if n.startswith('sluice.')})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout.split()
    assert package.split(".")[1] in out
    assert not set(out) & forbidden, f"{package} imports sluice.{set(out) & forbidden}"
