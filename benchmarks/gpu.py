"""`python -m benchmarks.gpu`: the project's GPU measurements in three profiles of parts, each part in its own
child process with its own time limit, its rows written into the output folder as it measures them.

    python -m benchmarks.gpu [--profile loan|extended|memory] [--parts PART ...] [--output DIR]
                             [--set PART.KEY=JSON] [--limit PART=SECONDS ...] [--budget-s S] [--dry-run]
    python -m benchmarks.gpu --fetch    the wheels and assets an offline GPU machine needs (`make gpu-wheels`)
    python -m benchmarks.gpu --list     the profiles: their parts, planned seconds, limits and budgets
    python -m benchmarks.gpu --merge A/results.json B/results.json ... --output DIR   one record of runs

Profiles (`gpu_parts.PROFILES`): `loan`, the default, takes the essential figures in one command of at
most 300 s on one H100, wheel setup and Triton compilation included; `extended` the rest in at most 480 s;
`memory` LoRA healing's GPU memory at 8B in at most 300 s. The parts run in order of value, each with its
own limit or what is left of the budget, whichever is less; an optional part runs only if its planned seconds
are left. `--parts` runs the named parts instead (570 s).
From a checkout on a GPU machine without hf-attn installed, `python3 -m benchmarks.gpu ...` is the same
command: it installs the carried wheels (.gpu/bundle, see `benchmarks/gpu_bundle.py`) and runs the parts
against the checkout. `--dry-run` goes through the setup of every part of every profile on any machine
(settings, shapes, files, imports, argument lists, output schema, the wheel list) and checks each profile's
planned seconds against its budget: exit status 1 names a part that cannot be set up or a profile that cannot
fit.
Output DIR: rows.jsonl (each part's rows and meta, appended as measured), log.txt (the parts' output),
results.json (per part: settings, rows, meta, status, environment, log tail; rewritten every few seconds
while a part runs) and results.md. A DIR written by this command before gets the new parts merged in (a part
run again replaces its entry).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Relative imports: from a checkout on the GPU machine this runs as `benchmarks.gpu`, before the wheels that
# make `hf_attn.eval` importable are set up (standard library only until the parts' child processes).
from . import gpu_bundle
from .gpu_parts import PARTS, PROFILES, SETUP_S, STOP_S, budget_problems, planned_s, render_table

PROG = "python -m benchmarks.gpu"
NAME = "hf-attn bench gpu"  # the JSON's "benchmark": marks an output directory as this command's
ROWS, LOG = "rows.jsonl", "log.txt"  # beside results.json / results.md: 4 files in all
PARTS_BUDGET_S = 570.0  # --parts without --budget-s: one command of at most 10 minutes
MIN_PART_S = 15  # a part of a profile is not started with less of the budget left
POLL_S = 5  # results.json is brought up to date this often while a part runs
STOP_GRACE_S = 5  # a stopped part gets this long for its cleanup after SIGTERM, then SIGKILL
PROBE = """
import importlib, json, platform, torch
out = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
           gpus=torch.cuda.device_count(),
           device=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("transformers", "triton", "accelerate", "huggingface_hub", "tokenizers", "hf_attn"):
    try:
        out[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as err:
        out[name] = f"not importable: {type(err).__name__}: {err}"
print(json.dumps(out))
"""


class Interrupted(Exception):
    """SIGTERM / SIGINT reached the runner: the running part is stopped and what it measured is kept."""


class _Parser(argparse.ArgumentParser):
    """A usage mistake in one line, exit status 2, as `hf_attn.tooling.cli.ArgumentParser` says it; kept
    here because this command runs before the carried wheels make `hf_attn` importable."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", choices=list(PROFILES), default="loan", help="which parts run (see --list)")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), help="run these parts instead of a profile's")
    p.add_argument("--output", default="results/gpu", help="directory of the results (results.json, ...)")
    p.add_argument("--set", action="append", default=[], metavar="PART.KEY=JSON", help="change a setting")
    p.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS", help="a part's time limit")
    p.add_argument(
        "--budget-s", type=float, help="wall seconds for the whole command (default: the profile's)"
    )
    p.add_argument("--dry-run", action="store_true", help="set every part up without a GPU; write nothing")
    p.add_argument(
        "--fetch", action="store_true", help="download the wheels, copy the assets (make gpu-wheels)"
    )
    p.add_argument("--list", action="store_true", help="list the profiles and their parts")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge these results.json files into --output")
    return p


def parse_sets(items: list[str]) -> dict[str, dict]:
    """--set PART.KEY=JSON -> {part: {key: value}}; ValueError for a bad item."""
    out: dict[str, dict] = {}
    for item in items:
        target, sep, text = item.partition("=")
        part, dot, key = target.partition(".")
        if not sep or not dot or part not in PARTS:
            raise ValueError(f"--set {item!r}: expected PART.KEY=JSON with PART one of {list(PARTS)}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text  # a bare string
        out.setdefault(part, {})[key] = value
    return out


def parse_limits(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        part, sep, text = item.partition("=")
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not sep or part not in PARTS or not 0 < seconds < math.inf:
            raise ValueError(
                f"--limit {item!r}: expected PART=SECONDS (finite, > 0) with PART one of {list(PARTS)}"
            )
        out[part] = seconds
    return out


def check_output_dir(output: Path) -> None:
    """ValueError unless `output` is a directory this command may write into: not a file, and its nearest
    existing ancestor writable (checked before any part runs, not after)."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file, not a directory; choose a directory")
    parent = output
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--output {output} is not writable ({parent} is not); choose another --output")


def load_existing(output: Path) -> dict:
    """The results.json of an earlier run into `output`, or a new record; ValueError for a foreign folder."""
    path = output / "results.json"
    if path.is_file():
        record = json.loads(path.read_text())
        if record.get("benchmark") == NAME:
            return record
    elif not output.exists() or not any(output.iterdir()):
        return {"benchmark": NAME, "parts": {}}
    raise ValueError(f"--output {output} holds files this command did not write; choose a new directory")


def render(record: dict) -> str:
    """results.md: a status table, then each part's table with its settings and meta."""
    parts = [name for name in PARTS if name in record["parts"]]
    keys = ("status", "seconds", "planned_s", "date")
    status_rows = [dict(part=n, **{k: record["parts"][n].get(k) for k in keys},
                        rows=len(record["parts"][n]["rows"]),
                        device=record["parts"][n]["environment"].get("device"))
                   for n in parts]  # fmt: skip
    columns = (("part", "part", ""), ("status", "status", ""), ("s", "seconds", ".0f"),
               ("planned s", "planned_s", "d"), ("rows", "rows", "d"), ("device", "device", ""),
               ("date", "date", ""))  # fmt: skip
    lines = [f"# {NAME}", "", render_table(columns, status_rows)]
    for name in parts:
        p = record["parts"][name]
        lines += ["", f"## {name}: {PARTS[name].about}", ""]
        lines += [f"`{p['command']}` on {p['environment'].get('device')}, {p['date']}: {p['status']}", ""]
        if p["rows"]:
            lines += [render_table(p["columns"], p["rows"]), ""]
        if p["meta"]:
            lines += ["meta: " + json.dumps(p["meta"], default=str), ""]
        lines += ["settings: " + json.dumps(p["settings"]), ""]
    return "\n".join(lines).rstrip() + "\n"


def write(record: dict, output: Path) -> None:
    """results.json + results.md, each replaced atomically."""
    output.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("results.json", json.dumps(record, indent=1, default=str) + "\n"),
        ("results.md", render(record)),
    ):
        tmp = output / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, output / name)


def merge(files: list[str], output: Path) -> int:
    """Parts of several results.json files (later files win) merged into `output`'s record."""
    record = load_existing(output)
    for name in files:
        try:
            other = json.loads(Path(name).read_text())
        except (OSError, ValueError):  # missing, unreadable or not JSON
            other = {}
        if not isinstance(other, dict) or other.get("benchmark") != NAME:
            raise ValueError(f"--merge {name} is not a results.json of {PROG}")
        record["parts"].update(other["parts"])
    write(record, output)
    print(f"written: {output / 'results.json'}, {output / 'results.md'} ({len(record['parts'])} parts)")
    return 0


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's process group (its cleanup runs), SIGKILL after STOP_GRACE_S."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _die_with_runner() -> None:
    """In a part's process before it starts: SIGTERM to it when the runner dies, even of SIGKILL, so that no
    part outlives the command in its own process group (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def read_rows(path: Path, part: str, offset: int = 0) -> dict:
    """The rows, meta, columns and settings that `part` appended to `path` after byte `offset`."""
    out = {"rows": [], "meta": {}, "columns": [], "settings": {}}
    if not path.is_file():
        return out
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    for line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if item.get("part") != part:
            continue
        if "row" in item:
            out["rows"].append(item["row"])
        if "meta" in item:
            out["meta"].update(item["meta"])
        if "columns" in item:
            out["columns"], out["settings"] = item["columns"], item["settings"]
    return out


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def run_part(name: str, overrides: dict, limit: float, env: dict, output: Path, progress) -> dict:
    """Run one part in its own process group with a time limit, its rows appended to output/rows.jsonl and
    its output to output/log.txt; `progress(result)` every POLL_S seconds with what it measured so far.
    Returns its record (status, seconds, rows, meta, log tail); "interrupted": the runner got SIGTERM."""
    rows_file, log_file = output / ROWS, output / LOG
    offsets, start = (_size(rows_file), _size(log_file)), time.monotonic()
    argv = [sys.executable, "-m", "benchmarks.gpu_parts", "run", name, json.dumps(overrides),
            str(rows_file)]  # fmt: skip
    status, interrupted = None, False
    with open(log_file, "a") as log:
        proc = subprocess.Popen(argv, cwd=gpu_bundle.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_runner)  # fmt: skip
        try:
            while status is None:
                left = limit - (time.monotonic() - start)
                try:
                    code = proc.wait(timeout=max(0.1, min(POLL_S, left)))
                    status = "ok" if code == 0 else f"failed (exit {code})"
                except subprocess.TimeoutExpired:
                    if left <= POLL_S:
                        status = f"timed out after {limit:.0f} s"
                    else:
                        progress(dict(status="running", seconds=round(time.monotonic() - start, 1),
                                      limit_s=limit, **read_rows(rows_file, name, offsets[0])))  # fmt: skip
        except (Interrupted, KeyboardInterrupt):
            status, interrupted = "stopped: the command was interrupted", True
        finally:
            if proc.poll() is None:
                _stop(proc)
    with open(log_file, "rb") as f:
        f.seek(offsets[1])
        tail = f.read().decode(errors="replace").splitlines()[-40:]
    if status.startswith("failed") and tail:
        status += ": " + tail[-1][:200]
    return dict(status=status, seconds=round(time.monotonic() - start, 1), limit_s=limit, log_tail=tail,
                interrupted=interrupted, **read_rows(rows_file, name, offsets[0]))  # fmt: skip


def profile_lines() -> tuple[list[str], list[str]]:
    """(one line per profile: planned seconds against its budget and the parts, its problems)."""
    lines, problems = [], []
    for profile in PROFILES.values():
        found = budget_problems(profile)
        problems += found
        parts = ", ".join(f"{n} {PARTS[n].plan_s}" for n in profile.parts)
        extra = "".join(f"; if time remains: {n} {PARTS[n].plan_s}" for n in profile.if_time)
        verdict = "CANNOT FIT" if found else "fits"
        lines.append(f"profile {profile.name}: planned {planned_s(profile)} s of {profile.budget_s} s "
                     f"(setup {SETUP_S}, stop {STOP_S}, {parts}{extra}): {verdict}")  # fmt: skip
    return lines, problems


def dry_run(parts: list[str], overrides: dict, env: dict, *, in_process: bool = False) -> int:
    """Both profiles' budgets, the wheel list and every part's setup in one child process (`in_process`:
    here, where hf-attn is installed, as the tests do): 0 if all hold."""
    lines, problems = profile_lines()
    print("\n".join(lines))
    problems += gpu_bundle.check_wheel_list()
    bundle = gpu_bundle.bundle_dir()
    bundle_note = "not fetched (make gpu-wheels)"
    if bundle.exists():
        problems += gpu_bundle.check_bundle(bundle)
        manifest = (
            json.loads((bundle / "manifest.json").read_text()) if (bundle / "manifest.json").is_file() else {}
        )
        bundle_note = f"{manifest.get('total_bytes', 0) / 2**20:.1f} MiB with the working tree"
    wheels = ", ".join(f"{n}=={v}" for n, v, _ in gpu_bundle.WHEELS)
    print(f"wheels: {wheels}; bundle {bundle_note}" + "".join(f"\n  PROBLEM {p}" for p in problems))
    settings = {name: overrides.get(name, {}) for name in parts}
    if in_process:
        from benchmarks.gpu_parts import dry_run as setups

        results = setups(settings)
    else:
        argv = [sys.executable, "-m", "benchmarks.gpu_parts", "dry-run", json.dumps(settings)]
        proc = subprocess.run(argv, cwd=gpu_bundle.ROOT, env=env, capture_output=True, text=True, timeout=600)
        results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or len(results) != len(parts):
            print(f"{PROG}: the dry-run child failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
            return 1
    for r in results:
        if r["ok"]:
            print(f"{r['part']}: ok" + "".join(f"\n  {line}" for line in r["plan"]))
        else:
            print(f"{r['part']}: CANNOT BE SET UP: {r['error']}")
    return 0 if not problems and all(r["ok"] for r in results) else 1


def all_parts() -> list[str]:
    """Every part of every profile, each once, in profile order."""
    return list(dict.fromkeys(n for p in PROFILES.values() for n in p.parts + p.if_time))


def probe(env: dict) -> dict:
    """The machine's versions and device (a child process with the parts' environment); ValueError without
    a CUDA GPU."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=gpu_bundle.ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise OSError(f"the environment probe failed: {proc.stderr.strip()[-300:]}")
    environment = json.loads(proc.stdout.strip().splitlines()[-1])
    if not environment["device"]:
        raise ValueError(
            "no CUDA GPU here (torch.cuda.is_available() is False); use --dry-run to check the setup"
        )
    return environment


def plan_run(args) -> tuple[list[tuple[str, bool]], float]:
    """([(part, optional)] in running order, the budget in seconds) of this command."""
    if args.parts:
        return [(name, False) for name in args.parts], args.budget_s or PARTS_BUDGET_S
    profile = PROFILES[args.profile]
    todo = [(name, False) for name in profile.parts] + [(name, True) for name in profile.if_time]
    return todo, args.budget_s or profile.budget_s


def run_all(args, overrides: dict, limits: dict) -> int:
    """Probe the machine, then every part with its limit within the budget; results as they come."""
    todo, budget = plan_run(args)
    deadline = time.monotonic() + budget - STOP_S  # setting up the wheels and the probe count too
    output = Path(args.output)
    record = load_existing(output)
    env = gpu_bundle.child_env()
    environment = probe(env)
    print(f"environment: {json.dumps(environment)}", flush=True)
    output.mkdir(parents=True, exist_ok=True)
    write(record, output)  # the folder is this command's from now on
    bad, previous = False, signal.signal(signal.SIGTERM, _interrupt)
    try:
        for name, optional in todo:
            base = dict(date=datetime.date.today().isoformat(), environment=environment,
                        command=f"{PROG} --parts {name}" + "".join(
                            f" --set {name}.{k}={json.dumps(v)}" for k, v in overrides.get(name, {}).items()),
                        planned_s=PARTS[name].plan_s)  # fmt: skip
            left = deadline - time.monotonic()
            if left < (PARTS[name].plan_s if optional else MIN_PART_S):
                why = (
                    f"its planned {PARTS[name].plan_s} s are not left" if optional else "the budget is spent"
                )
                result = dict(status=f"not started: {why}", seconds=0, rows=[], meta={}, columns=[],
                              settings={}, log_tail=[], interrupted=False)  # fmt: skip
                bad |= not optional
            else:
                limit = min(limits.get(name, PARTS[name].limit_s), left)
                print(f"{name}: running (limit {limit:.0f} s, planned {PARTS[name].plan_s} s)", flush=True)

                def progress(partial, name=name, base=base):
                    record["parts"][name] = {**base, **partial}
                    write(record, output)

                result = run_part(name, overrides.get(name, {}), limit, env, output, progress)
                bad |= result["status"] != "ok"
            interrupted = result.pop("interrupted")
            record["parts"][name] = {**base, **result}
            write(record, output)
            print(
                f"{name}: {result['status']} ({result['seconds']:.0f} s, {len(result['rows'])} rows)",
                flush=True,
            )
            if interrupted:
                return 143
    except Interrupted:  # between two parts: what they wrote is on disk
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(render(record))
    print(f"written: {output / 'results.json'}, {output / 'results.md'}, {output / ROWS}, {output / LOG}")
    return 1 if bad else 0


def _interrupt(signum, frame) -> None:
    raise Interrupted(f"signal {signum}")


def list_profiles() -> int:
    for profile in PROFILES.values():
        print(f"{PROG} --profile {profile.name}: {profile.about}; budget {profile.budget_s} s, planned "
              f"{planned_s(profile)} s (setup {SETUP_S} + stop {STOP_S} + parts)")  # fmt: skip
        for name in profile.parts + profile.if_time:
            part, note = PARTS[name], " (if time remains)" if name in profile.if_time else ""
            print(f"  {name:<13} planned {part.plan_s:>3} s, limit {part.limit_s:>3} s  {part.about}{note}")
    return 0


def fetch() -> int:
    manifest = gpu_bundle.fetch()
    for w in manifest["wheels"]:
        print(f"{w['file']}  {w['bytes'] / 2**20:.2f} MiB")
    mib = {k: manifest[k] / 2**20 for k in ("wheel_bytes", "asset_bytes", "tree_bytes", "total_bytes")}
    print(
        f"wheels {mib['wheel_bytes']:.1f} MiB + assets {mib['asset_bytes']:.1f} MiB + tracked files "
        f"{mib['tree_bytes']:.1f} MiB = {mib['total_bytes']:.1f} MiB of 64 MiB in {gpu_bundle.BUNDLE}"
    )
    for top, size in sorted(manifest["untracked_bytes"].items(), key=lambda kv: -kv[1])[:5]:
        print(f"warning: untracked {top} ({size / 2**20:.1f} MiB) travels too unless ignored or removed")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        overrides, limits = parse_sets(args.set), parse_limits(args.limit)
        if args.budget_s is not None and not 0 < args.budget_s < math.inf:
            raise ValueError(f"--budget-s must be a finite number of seconds > 0, got {args.budget_s}")
        if args.merge or not (args.list or args.fetch or args.dry_run):  # what writes into --output
            check_output_dir(Path(args.output))
            load_existing(Path(args.output))  # a folder of other files: refused before any part runs
        if args.list:
            return list_profiles()
        if args.fetch:
            return fetch()
        if args.merge:
            return merge(args.merge, Path(args.output))
        if args.dry_run:
            return dry_run(args.parts or all_parts(), overrides, gpu_bundle.child_env(install=False))
        return run_all(args, overrides, limits)
    except (ValueError, OSError) as err:
        line = " | ".join(part.strip() for part in str(err).strip().splitlines()) or type(err).__name__
        print(f"{PROG}: error: {line}", file=sys.stderr)  # one line, as every hf-attn command
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
