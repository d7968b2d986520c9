"""Parts of `hf-attn bench gpu` that run other commands: the compiled kernel tests and the engine benchmark.

kernel-tests: `pytest tests/test_mla_kernel.py -k on_gpu` (the compiled Triton kernel against the float64
reference and `llama_mla` decoded through it; they skip without CUDA), one row per test from pytest's JUnit
XML. engine: `hf-attn bench engine ARGS` where this checkout has that command (`--set engine.args=[...]`);
otherwise one row saying it is not available.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from hf_attn.eval.bench.gpu_bundle import ROOT, is_checkout
from hf_attn.eval.bench.gpu_parts import Adapter

ENGINE_MODULE = "hf_attn.eval.engine.bench"


def _pytest(args: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _test_args(settings: dict) -> list[str]:
    if not is_checkout():
        raise OSError("the kernel tests need a source checkout (tests/ is not installed with the package)")
    path = ROOT / settings["tests"]
    if not path.is_file():
        raise OSError(f"{path} does not exist; set kernel-tests.tests to the kernel test file")
    return [settings["tests"], "-k", settings["select"]]


def plan_tests(settings: dict) -> list[str]:
    """How many tests `-k select` picks in the test file: its test functions whose name contains `select`,
    times their parametrizations (read off the module, not collected: no second interpreter needed)."""
    _test_args(settings)
    spec = importlib.util.spec_from_file_location("_hf_attn_gpu_kernel_tests", ROOT / settings["tests"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    count = 0
    for name, fn in vars(module).items():
        if name.startswith("test") and settings["select"] in name and callable(fn):
            count += math.prod(
                len(m.args[1]) for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"
            )
    if not count:
        raise ValueError(f"no test of {settings['tests']} matches -k {settings['select']!r}")
    return [f"{count} tests: pytest {settings['tests']} -k {settings['select']}"]


def run_tests(settings: dict, emit) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        proc = _pytest(["-q", "-rA", f"--junitxml={report}", *_test_args(settings)])
        emit(meta={"pytest_exit": proc.returncode, "summary": (proc.stdout.strip().splitlines() or [""])[-1]})
        if not report.is_file():
            raise RuntimeError(f"pytest wrote no report (exit {proc.returncode}): {proc.stderr[-500:]}")
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for kind in ("failure", "error", "skipped"):
                found = case.find(kind)
                if found is not None:
                    outcome, message = kind, (found.get("message") or "").splitlines()[:1]
                    message = message[0][:200] if message else ""
            emit({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                  "message": message})  # fmt: skip
    if proc.returncode != 0:  # the rows say which tests
        raise RuntimeError(f"pytest exit {proc.returncode}: {(proc.stdout.strip().splitlines() or [''])[-1]}")


def _engine_available() -> str | None:
    """None where `hf-attn bench engine` exists here, else why not."""
    if importlib.util.find_spec(ENGINE_MODULE) is None:
        return f"not available: {ENGINE_MODULE} is not in this checkout"
    from hf_attn.eval.cli import COMMANDS

    if "bench engine" not in COMMANDS:
        return "not available: `hf-attn bench engine` is not registered in eval/cli.py"
    return None


def plan_engine(settings: dict) -> list[str]:
    if not isinstance(settings["args"], list):
        raise ValueError(f"engine.args must be a JSON list of strings, got {settings['args']!r}")
    why = _engine_available()
    return [why or f"hf-attn bench engine {' '.join(settings['args'])}"]


def run_engine(settings: dict, emit) -> None:
    why = _engine_available()
    command = "hf-attn bench engine " + " ".join(settings["args"])
    if why:
        emit({"command": command, "status": why, "detail": ""})
        return
    argv = [sys.executable, "-m", "hf_attn.eval.cli", "bench", "engine", *settings["args"]]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).strip().splitlines() or [""]
    emit({"command": command, "status": f"exit {proc.returncode}", "detail": lines[-1][:300]})
    emit(meta={"output_tail": "\n".join(lines[-60:])})


ADAPTERS = {
    "kernel-tests": Adapter(
        defaults={"tests": "tests/test_mla_kernel.py", "select": "on_gpu"},
        columns=(
            ("test", "test", ""),
            ("outcome", "outcome", ""),
            ("s", "seconds", ".1f"),
            ("message", "message", ""),
        ),  # fmt: skip
        plan=plan_tests,
        run=run_tests,
    ),
    "engine": Adapter(
        defaults={"args": []},
        columns=(("command", "command", ""), ("status", "status", ""), ("last line", "detail", "")),
        plan=plan_engine,
        run=run_engine,
    ),
}
