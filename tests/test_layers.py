"""The layer stack: hf_attn runtime <- hf_attn.tooling <- hf_attn.conversion <- hf_attn.eval <- benchmarks
(imports point down only; benchmarks/ is not installed, so nothing installed imports it), `import hf_attn`
loads nothing above the runtime, and one `hf-attn` command of at most 12 subcommands fronts the user's
tools."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> (its package name, the layer's rank: a module may import only packages of its rank or below)
LAYERS = {
    "hf_attn": ("hf_attn", 0),
    "hf_attn/tooling": ("hf_attn.tooling", 1),
    "conversion": ("hf_attn.conversion", 2),
    "eval": ("hf_attn.eval", 3),
    "benchmarks": ("benchmarks", 4),  # the project's own benchmarks and experiments, run from a checkout
}
INSTALLED = [folder for folder in LAYERS if folder != "benchmarks"]
MAX_SUBCOMMANDS = 12
RANK = {package: rank for package, rank in LAYERS.values()}


def _layer_of_module(name: str) -> int | None:
    """Rank of the project package a dotted module name belongs to (longest match), None if not ours."""
    best = None
    for package, rank in RANK.items():
        if name == package or name.startswith(package + "."):
            if best is None or len(package) > len(best[0]):
                best = (package, rank)
    if best is None and name.split(".")[0] in ("conversion", "eval"):  # the checkout's alias names
        return RANK["hf_attn." + name.split(".")[0]]
    return None if best is None else best[1]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _modules():
    for folder, (_, rank) in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            inner = path.relative_to(ROOT / folder).parts
            if folder == "hf_attn" and inner[0] == "tooling":
                continue  # its own layer
            yield path, rank


@pytest.mark.parametrize("path,rank", list(_modules()), ids=lambda v: str(v) if isinstance(v, Path) else "")
def test_imports_point_down(path, rank):
    up = [n for n in _imports(path) if (r := _layer_of_module(n)) is not None and r > rank]
    if path == ROOT / "hf_attn" / "assets.py":  # the former name of hf_attn.tooling.assets, kept for users
        up = [n for n in up if not n.startswith("hf_attn.tooling.assets")]
    assert not up, f"{path.relative_to(ROOT)} (layer {rank}) imports upward: {sorted(set(up))}"


def test_runtime_import_loads_no_tooling():
    code = (
        "import sys, hf_attn\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('conversion', 'eval')\n"
        "    or m.startswith(('hf_attn.tooling', 'hf_attn.conversion', 'hf_attn.eval', 'hf_attn.assets')))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_nothing_installed_imports_benchmarks():
    """benchmarks/ is not installed: an installed module that imported it (even lazily, inside a function)
    would fail outside a checkout. test_imports_point_down says the same by rank; this names the rule."""
    bad = []
    for folder in INSTALLED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if any(n == "benchmarks" or n.startswith("benchmarks.") for n in _imports(path)):
                bad.append(str(path.relative_to(ROOT)))
    assert not bad, bad


def test_one_command_lists_every_subcommand():
    from hf_attn.eval import cli

    res = subprocess.run([sys.executable, "-m", "hf_attn.eval.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for name in cli.COMMANDS:
        assert name in res.stdout
    bad = subprocess.run([sys.executable, "-m", "hf_attn.eval.cli", "convrt"], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "convrt" in bad.stderr
    assert len(cli.COMMANDS) <= MAX_SUBCOMMANDS, sorted(cli.COMMANDS)
    assert not any(module.startswith("benchmarks") for module, _ in cli.COMMANDS.values())


@pytest.mark.parametrize("name", ["bench gpu", "bench scale", "bench engine", "bench mla-kernel-registers"])
def test_a_benchmark_of_the_checkout_is_named_by_its_module_command(name, capsys):
    """`hf-attn bench X` of a benchmark that runs from the checkout: one line naming `python -m benchmarks.X`,
    exit status 2, nothing imported from benchmarks/."""
    from hf_attn.eval import cli

    assert cli.main([*name.split(), "--help"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"python -m {cli.BENCHMARKS[name]} (from a checkout)" in err


def test_every_benchmark_module_command_exists():
    """Each `python -m benchmarks.X` that the error path names runs from the checkout (a module with main and
    a `__main__` block, or a package with __main__.py), and none of them shadows a subcommand."""
    import importlib.util

    from hf_attn.eval import cli

    assert not set(cli.BENCHMARKS) & set(cli.COMMANDS)
    for module in cli.BENCHMARKS.values():
        path = ROOT / Path(*module.split("."))
        main = path / "__main__.py" if path.is_dir() else path.with_suffix(".py")
        assert main.is_file(), module
        assert 'if __name__ == "__main__":' in main.read_text(), module
    sys.path.insert(0, str(ROOT))
    try:
        missing = [m for m in cli.BENCHMARKS.values() if importlib.util.find_spec(m) is None]
    finally:
        sys.path.remove(str(ROOT))
    assert not missing, missing


def test_every_subcommand_and_module_alias_resolves():
    """Each subcommand's module has main(argv) -> int, and each documented module command still exists."""
    import importlib
    import importlib.util

    from hf_attn.eval import cli

    for name in cli.COMMANDS:
        assert callable(cli.command_main(name)), name
    aliases = [
        "conversion.gqa",
        "conversion.mla",
        "conversion.expand",
        "conversion.heal",
        "conversion.training",
        "conversion.export",
        "eval.perplexity",
        "eval.study",
        "benchmarks.attention",
        "eval.bench.decode",
        "benchmarks.heal",
        "benchmarks.mla_decode",
        "benchmarks.perplexity",
        "hf_attn.tooling.assets",
        "hf_attn.assets",
    ]
    sys.path.insert(0, str(ROOT))  # the module commands run from the checkout
    try:
        missing = [m for m in aliases if importlib.util.find_spec(m) is None]
    finally:
        sys.path.remove(str(ROOT))
    assert not missing, missing


def test_every_package_folder_is_installed():
    """pyproject.toml lists packages explicitly (conversion/ and eval/ are mapped under hf_attn): a new folder
    with an __init__.py must be listed, or an installed (non-editable) hf-attn would lack it; benchmarks/
    never is (it runs from a checkout)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder in INSTALLED:
        package = LAYERS[folder][0]
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert found == listed, {"not listed": sorted(found - listed), "listed, missing": sorted(listed - found)}
    assert not any(name.split(".")[0] == "benchmarks" for name in listed), sorted(listed)
    assert (ROOT / "benchmarks" / "__init__.py").is_file()


# ------------------------------------------------------------------------------ conversion/: its own imports

# a function-level import of a project module inside conversion/ or eval/ is allowed only for these (module
# prefix -> why): an optional or heavy dependency that the code path needs and that a command which does not
# take that path should not load. Every other import is at the top of its module, where a cycle would show.
LAZY_IMPORTS_ALLOWED = {
    "hf_attn.kernels": "Triton: present only with the `kernels` extra, used only on CUDA",
    "hf_attn.eval.tasks": "lm-eval: loaded only by a run that measures task accuracy",
}


def _module_name(path: Path) -> str:
    """The dotted name `path` (under conversion/) installs as."""
    parts = list(path.relative_to(ROOT / "conversion").with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["hf_attn.conversion", *parts])


def _project_module(name: str) -> str | None:
    """`name` as an installed project module name (the checkout's `conversion.` alias mapped), else None."""
    if name.split(".")[0] in ("conversion", "eval"):
        name = "hf_attn." + name
    return name if name == "hf_attn" or name.startswith("hf_attn.") else None


@pytest.mark.parametrize("folder", ["hf_attn", "conversion", "eval"])
def test_no_function_level_project_imports(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in filter(None, map(_project_module, names)):
                    if not any(name == m or name.startswith(m + ".") for m in LAZY_IMPORTS_ALLOWED):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {func.name}() imports {name}")
    assert not found, "imports belong at the top of the module:\n" + "\n".join(found)


def _conversion_graph() -> dict[str, set[str]]:
    """module -> the conversion modules its top-level imports run (a package's __init__ included, a
    submodule's own packages left out: they are initialised before it runs)."""
    modules = {_module_name(p): p for p in (ROOT / "conversion").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
                if isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                    base = _project_module(sub.module) or ""
                    deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in sub.names}
                elif isinstance(sub, ast.Import):
                    deps |= {m for a in sub.names if (m := _project_module(a.name))}
        closed = set()
        for dep in deps:  # importing a.b.c runs a.b's __init__ too
            parts = dep.split(".")
            closed |= {".".join(parts[:i]) for i in range(3, len(parts) + 1)}
        graph[name] = {d for d in closed & set(modules) if d != name and not name.startswith(d + ".")}
    return graph


def test_specs_is_a_leaf_and_conversion_has_no_import_cycle():
    graph = _conversion_graph()
    assert graph["hf_attn.conversion.specs"] == set(), "specs imports only the layers below conversion"
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


@pytest.mark.parametrize("folder", ["hf_attn", "conversion", "eval"])
def test_no_private_name_is_imported_from_another_module(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or _project_module(node.module or "")):
                private = [
                    a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                ]
                if private:
                    found.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} imports {private} from {node.module}"
                    )
    assert not found, "make the name public or move it:\n" + "\n".join(found)


@pytest.mark.parametrize("folder", ["hf_attn", "conversion", "eval"])
def test_modules_and_functions_stay_readable(folder):
    """No module over 600 lines, no function over 80."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 600:
            found.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}(): {length} lines")
    assert not found, "\n".join(found)
