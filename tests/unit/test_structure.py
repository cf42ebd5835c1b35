"""The layout's rules, checked on the source (the AST of every module), so they hold from now on."""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest
import tomllib
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "serve_app"
# Build time only, never imported by what runs in a replica: the demo model zoo (torch), and the
# tools (the CLI and the commands that build, calibrate and import models and render the KubeRay
# manifest, the ingress settings they start Ray with, a worker pod's drain hook).
BUILD_TIME = ("serve_app.zoo", "serve_app.tools")
# The most Python modules one folder of the package holds (its `__init__.py` counted): past it, a
# folder is split by concern into sub-packages a newcomer can find their way in.
MAX_MODULES_PER_FOLDER = 12


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


def test_no_module_imports_in_a_circle():
    """Type-checking imports count: a circle they close is one a runtime import would close too."""
    graph = {m: {i for i in found if i in MODULES and i != m} for m, found in MODULES.items()}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"an import circle: {' -> '.join(e.args[1])}") from None


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
    policies += [m for m in MODULES if within(m, "serve_app.router.admission", "serve_app.process")]
    policies += ["serve_app.router.routing.cascade", "serve_app.router.routing.catalog", "serve_app.router.routing.versions"]
    assert offenders(policies, ("ray",)) == {}


@pytest.mark.skipif(sys.platform == "win32", reason="subprocess import check")
def test_loading_the_application_loads_no_zoo_no_tools_and_no_torch():
    code = (
        "import sys, serve_app.app; "
        "bad = [m for m in sys.modules if m.startswith(('serve_app.zoo', 'serve_app.tools', 'torch', 'benchmarks'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_the_installed_distribution_holds_only_serve_app():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=config["include"])
    assert "serve_app" in packages and "serve_app.router" in packages
    assert [p for p in packages if not within(p, "serve_app")] == []
    # Every folder of modules is a package (has its `__init__.py`), so none is left out of the wheel.
    assert {module_name(folder / "__init__.py") for folder in module_counts(PACKAGE)} <= set(packages)


def module_counts(package: Path) -> dict[Path, int]:
    """Each folder under `package` (itself included) that holds Python modules, and how many it
    holds directly, its `__init__.py` included."""
    folders = [package, *(d for d in sorted(package.rglob("*")) if d.is_dir())]
    counts = {d: len(list(d.glob("*.py"))) for d in folders}
    return {d: n for d, n in counts.items() if n}


def crowded(package: Path, limit: int = MAX_MODULES_PER_FOLDER) -> dict[str, int]:
    return {d.relative_to(package.parent).as_posix(): n for d, n in module_counts(package).items() if n > limit}


def test_no_folder_holds_more_than_twelve_modules(tmp_path: Path):
    assert crowded(PACKAGE) == {}, "split the folder by concern into sub-packages"
    # The count is of the folder's own modules, `__init__.py` included, not of its sub-packages'.
    folder = tmp_path / "serve_app" / "router"
    (folder / "edge").mkdir(parents=True)
    for i in range(12):
        (folder / f"m{i}.py").write_text("")
        (folder / "edge" / f"m{i}.py").write_text("")
    assert crowded(tmp_path / "serve_app") == {}
    (folder / "__init__.py").write_text("")
    assert crowded(tmp_path / "serve_app") == {"serve_app/router": 13}


def private_imports(found: set[str]) -> list[str]:
    """Modules or names of other projects that are private to them (a part with one leading underscore)."""
    return sorted(
        i for i in found if not within(i, "serve_app") and any(p.startswith("_") and not p.startswith("__") for p in i.split("."))
    )


def patches(path: Path) -> list[str]:
    """Assignments to an attribute of another project's module or class (or of a name bound to
    one), and setattr/delattr on them: the ways code replaces a third-party function in place."""
    tree = ast.parse(path.read_text(), str(path))
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign.update((a.asname or a.name).split(".")[0] for a in node.names if not within(a.name, "serve_app"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not within(node.module or "", "serve_app"):
            foreign.update(a.asname or a.name for a in node.names)

    def root(node: ast.expr) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):  # `cycle = uvicorn_module.Class` makes `cycle` foreign too
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute | ast.Name) and root(node.value) in foreign:
            foreign.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign | ast.AnnAssign)
            else []
        )
        found += [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and root(t) in foreign]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and root(node.args[0]) in foreign:
                found.append(ast.unparse(node))
    return found


def test_no_private_imports_of_other_projects():
    bad = {m: private_imports(found) for m, found in MODULES.items()}
    assert {m: f for m, f in bad.items() if f} == {}
    assert private_imports({"ray.serve._private.http_util", "ray.serve", "__future__.annotations"}) == [
        "ray.serve._private.http_util"
    ]


def test_no_function_of_another_project_is_replaced(tmp_path: Path):
    bad = {module_name(p): patches(p) for p in sorted(PACKAGE.rglob("*.py"))}
    assert {m: f for m, f in bad.items() if f} == {}
    # The check finds the shapes a patch takes.
    sample = tmp_path / "patch.py"
    sample.write_text(
        "import uvicorn.protocols.http.httptools_impl as h\nfrom ray.serve import _private\n"
        "cycle = h.RequestResponseCycle\ncycle.send = None\n_private.X = 1\nsetattr(h, 'y', 2)\n"
        "import logging\nlogger = logging.getLogger()\nlogger.propagate = False\n"
    )
    assert patches(sample) == ["cycle.send", "_private.X", "setattr(h, 'y', 2)"]


def test_no_module_names_anything_private():
    """The issue's own check, `grep -rn "_private" serve_app`: no Ray Serve private module, and no
    pydantic private state read or written behind pydantic's back."""
    found = [
        f"{p}:{i}"
        for p in sorted(PACKAGE.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "_private" in line
    ]
    assert found == []
