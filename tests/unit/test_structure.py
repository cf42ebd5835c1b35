"""The layout's rules, checked on the source (the AST of every module), so they hold from now on."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "serve_app"
# Build time only: the demo model zoo (torch) and the commands that build and calibrate it.
BUILD_TIME = (
    "serve_app.zoo",
    "serve_app.cli",
    "serve_app.catalog_build",
    "serve_app.catalog_calibrate",
    "serve_app.catalog_import",
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module `path` imports, at the top or inside a function; relative imports resolved."""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            base = node.module if node.level == 0 and node.module else base
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def offenders(modules: list[str], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {m: sorted(i for i in MODULES[m] if within(i, *forbidden)) for m in modules}
    return {m: found for m, found in bad.items() if found}


def test_the_walk_sees_the_package_and_its_imports(tmp_path: Path):
    assert len(MODULES) > 40 and "serve_app.router.ingress" in MODULES
    assert "serve_app.contract" in MODULES["serve_app.models.classifier"]
    # A relative import names the module it reaches.
    module = tmp_path / "serve_app" / "models" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text("from ..router import ingress\nfrom . import base\n")
    assert {"serve_app.router.ingress", "serve_app.models.base"} <= imports(module, tmp_path)


def test_the_product_imports_nothing_from_the_benchmarks():
    assert offenders(list(MODULES), ("benchmarks",)) == {}


def test_models_import_neither_the_router_nor_the_scheduling_policies():
    models = [m for m in MODULES if within(m, "serve_app.models")]
    assert models and offenders(models, ("serve_app.router", "serve_app.scheduling")) == {}


def test_nothing_that_runs_at_serve_time_imports_build_time_code():
    serving = [m for m in MODULES if not within(m, *BUILD_TIME)]
    assert "serve_app.app" in serving and offenders(serving, BUILD_TIME) == {}


def test_policies_import_no_ray():
    policies = [
        m for m in MODULES if within(m, "serve_app.scheduling", "serve_app.contract", "serve_app.cache", "serve_app.link")
    ]
    policies += ["serve_app.router.cascade", "serve_app.router.callers", "serve_app.router.catalog", "serve_app.router.versions"]
    assert offenders(policies, ("ray",)) == {}


@pytest.mark.skipif(sys.platform == "win32", reason="subprocess import check")
def test_loading_the_application_loads_no_zoo_and_no_torch():
    code = (
        "import sys, serve_app.app; "
        "bad = [m for m in sys.modules if m.startswith(('serve_app.zoo', 'torch', 'benchmarks'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_the_installed_distribution_holds_only_serve_app():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=config["include"])
    assert "serve_app" in packages and "serve_app.router" in packages
    assert [p for p in packages if not within(p, "serve_app")] == []
