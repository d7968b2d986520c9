"""What users read carries no work-log vocabulary: README, docs (research write-ups included), every command's
--help, and the docstrings of the modules (installed, and the benchmarks of the checkout). A hit names the
file (or command) and the line.

The patterns are independent of the texts they check: numbered rounds of work, tracker numbers, sessions,
issues, "targets" met or missed, and the history phrasing of a notebook."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORK_LOG = re.compile(
    r"\bround \d"  # numbered rounds of work
    r"|(?<![\w&/\[])#\d{1,3}\b"  # tracker numbers
    r"|\bsessions?\b"
    r"|\bissues?\b"
    r"|\bMISSED\b"
    r"|\btargets? (?:are |is |were |was )?(?:not )?(?:met|missed)\b"
    r"|\bNext, untried\b",
    re.IGNORECASE,
)
PACKAGES = ("hf_attn", "conversion", "eval", "benchmarks")  # benchmarks/: run from the checkout


def hits(text: str, where: str) -> list[str]:
    return [
        f"{where}:{i}: {line.strip()[:120]}"
        for i, line in enumerate(text.splitlines(), 1)
        if WORK_LOG.search(line)
    ]


def test_the_pattern_finds_what_it_should_and_nothing_else():
    bad = ["as in round 3", "fixed in #12", "the session that wrote it", "issue 14's check", "MISSED",
           "the targets are met", "Next, untried: x"]  # fmt: skip
    good = ["the target word", "pip install --target DIR", "see #section", "color #1f77b4", "a tissue"]
    assert all(WORK_LOG.search(t) for t in bad)
    assert not any(WORK_LOG.search(t) for t in good)


def test_readme_and_docs():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [h for f in files for h in hits(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_docstrings_of_the_installed_modules():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
            for node in nodes:
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    found += hits(doc, f"{path.relative_to(ROOT)} ({getattr(node, 'name', 'module')})")
    assert not found, "\n".join(found)


def _help(main, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), pytest.raises(SystemExit):
        main(argv)
    return out.getvalue()


def test_help_of_every_command():
    from hf_attn.eval import cli

    found = []
    usage = io.StringIO()
    with contextlib.redirect_stdout(usage):
        cli.main(["--help"])
    found += hits(usage.getvalue(), "hf-attn --help")
    for name in cli.COMMANDS:
        text = _help(cli.command_main(name), ["--help"])
        found += hits(text, f"hf-attn {name} --help")
    for module in cli.BENCHMARKS.values():  # python -m benchmarks.X (a package: its __main__)
        loaded = importlib.import_module(module)
        main = getattr(loaded, "main", None) or importlib.import_module(f"{module}.__main__").main
        found += hits(_help(main, ["--help"]), f"python -m {module} --help")
    assert not found, "\n".join(found)
