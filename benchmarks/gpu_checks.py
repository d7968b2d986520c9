"""`python -m benchmarks.gpu` part kernel-tests: `pytest tests/test_mla_kernel.py tests/test_fits_on_gpu.py -k
on_gpu` (the compiled Triton kernel against the float64 reference, `llama_mla` decoded through it, and the
conversions' layer fits on the GPU against the CPU's; they skip without CUDA). This
module is also the pytest plugin (`-p`) that appends one row per test to the part's rows file as the test
ends, so a run cut short keeps every finished test.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

from benchmarks.gpu_bundle import ROOT, is_checkout
from benchmarks.gpu_parts import Adapter

ROWS_ENV = "HF_ATTN_GPU_TEST_ROWS"  # the rows file the plugin appends to


def _test_files(settings: dict) -> list[str]:
    """The test files of `settings["tests"]` (a list of paths in the checkout, or one path)."""
    if not is_checkout():
        raise OSError("the kernel tests need a source checkout (tests/ is not installed with the package)")
    files = [settings["tests"]] if isinstance(settings["tests"], str) else list(settings["tests"])
    for name in files:
        if not (ROOT / name).is_file():
            raise OSError(f"{ROOT / name} does not exist; set kernel-tests.tests to the GPU test files")
    return files


def plan_tests(settings: dict) -> list[str]:
    """How many tests `-k select` picks in the test files: their test functions whose name contains `select`,
    times their parametrizations (read off the modules, not collected: no second interpreter needed)."""
    files, count = _test_files(settings), 0
    for i, name in enumerate(files):
        spec = importlib.util.spec_from_file_location(f"_hf_attn_gpu_tests_{i}", ROOT / name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for test, fn in vars(module).items():
            if test.startswith("test") and settings["select"] in test and callable(fn):
                count += math.prod(
                    len(m.args[1]) for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"
                )
    if not count:
        raise ValueError(f"no test of {files} matches -k {settings['select']!r}")
    return [f"{count} tests: pytest {' '.join(files)} -k {settings['select']}"]


def run_tests(settings: dict, emit) -> None:
    # `-o pythonpath=`: not the checkout's root first on sys.path (pyproject's setting for benchmarks/), where
    # its `hf_attn/` folder, which lacks `conversion` and `eval`, would hide the installed layout
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", __name__, "-q", "-rfE"]
    argv += ["-o", "pythonpath="]
    env = dict(os.environ, **{ROWS_ENV: emit.path})
    args = [*_test_files(settings), "-k", settings["select"]]
    proc = subprocess.run(argv + args, cwd=ROOT, env=env, capture_output=True, text=True)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    emit(meta={"pytest_exit": proc.returncode, "summary": summary})
    if proc.returncode != 0:  # the rows say which tests; a collection error only pytest's own output
        tails = f"{proc.stdout.strip()[-600:]} {proc.stderr.strip()[-300:]}"
        raise RuntimeError(f"pytest exit {proc.returncode}: {summary} {tails}")


def pytest_runtest_logreport(report) -> None:
    """pytest hook: a test's row once its call ends, or once its setup fails or skips it (no call then)."""
    path = os.environ.get(ROWS_ENV)
    if not path or not (report.when == "call" or (report.when == "setup" and report.outcome != "passed")):
        return
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        message = str(longrepr[-1])
    else:
        message = (str(longrepr).strip().splitlines() or [""])[-1] if longrepr else ""
    row = {"test": report.nodeid.split("::")[-1], "outcome": report.outcome,
           "seconds": round(report.duration, 2), "message": message[:200]}  # fmt: skip
    with open(path, "a") as f:
        f.write(json.dumps({"part": "kernel-tests", "row": row}) + "\n")


ADAPTERS = {
    "kernel-tests": Adapter(
        defaults={"tests": ["tests/test_mla_kernel.py", "tests/test_fits_on_gpu.py"], "select": "on_gpu"},
        columns=(
            ("test", "test", ""),
            ("outcome", "outcome", ""),
            ("s", "seconds", ".1f"),
            ("message", "message", ""),
        ),  # fmt: skip
        plan=plan_tests,
        run=run_tests,
    ),
}
