"""README's examples need nothing that README's own install commands do not bring (the examples
themselves run against a live server in tests/integration/shared_serve/test_app.py)."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", README, re.S)


def serve_install() -> dict[str, Requirement]:
    """What README's serve command installs: the package's dependencies and the extras it names."""
    (extras,) = re.findall(r'pip install -e "\.\[([\w,]+)\]" && serve-app serve', README)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras.split(","):
        wanted += project["optional-dependencies"][extra]
    return {canonicalize_name(r.name): r for r in map(Requirement, wanted)}


def pip_installs() -> set[str]:
    """Packages README's own `pip install NAME` lines add."""
    lines = [line for block in blocks("bash") for line in block.splitlines() if line.startswith("pip install ")]
    return {canonicalize_name(Requirement(word).name) for line in lines for word in line.split()[2:] if not word.startswith("-")}


def imported(code: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_python_examples_import_only_what_readme_installs() -> None:
    installed, added = serve_install(), pip_installs()
    distributions = packages_distributions()
    examples = blocks("python")
    assert len(examples) >= 2
    for module in set().union(*map(imported, examples)):
        top = module.split(".")[0]
        if top in sys.stdlib_module_names:
            continue
        names = {canonicalize_name(d) for d in distributions.get(top, [])}
        assert names & (installed.keys() | added), f"README imports {module}; no install in README brings it"
    # Triton's HTTP client imports only with its extra's dependencies.
    assert "http" in installed["tritonclient"].extras
