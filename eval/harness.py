"""lm-evaluation-harness on any checkpoint hf-attn produces (also its own attention implementations).

`lm_eval.simple_evaluate` with the model loaded here: `hf_attn` is imported first (so `llama_mla` and the
`hf_attn_*` attention implementations resolve), then `AutoModelForCausalLM` with the given
`attn_implementation` and dtype, handed to lm-eval's `HFLM`. Tasks are lm-eval names (hub datasets: need
network access or a filled datasets cache), the local tasks of `eval/tasks/` (built offline from
*Persuasion*, `hf_attn.tooling.task_data`), or task YAML files / directories given with `--include-path` or
as a path in `--tasks`. Only when a task is not local is lm-eval's full task index read (some seconds).

    python -m eval.harness [--model PATH_OR_HUB_ID] [--tasks persuasion_lastword,persuasion_nextsent]
        [--include-path DIR ...] [--attn-implementation NAME] [--dtype float32|bfloat16|float16]
        [--batch-size 8] [--device auto|cpu|cuda] [--limit N] [--num-fewshot K] [--seed 1234]
        [--trust-remote-code] [--log-samples] [--output results.json]

Prints one line per task metric and writes the JSON record (lm-eval's results, configs, versions, plus the
model hash and settings) to `--output`. Bad input and offline failures: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hf_attn.tooling import loading
from hf_attn.tooling.cli import ArgumentParser, add_deprecated_alias, run_command
from hf_attn.tooling.devices import DEFAULT_DEVICE, DEVICE_HELP, announce_device, resolve_device
from hf_attn.tooling.errors import UserError, check_number, check_seed, one_line
from hf_attn.tooling.files import check_output, write_json

PROG = "hf-attn harness"

LOCAL_TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DEFAULT_TASKS = ("persuasion_lastword", "persuasion_nextsent")


def _is_offline_error(err: BaseException) -> bool:
    """True if `err` (or anything in its chain) says the hub could not be reached."""
    seen = 0
    while err is not None and seen < 16:
        name = type(err).__name__
        text = str(err).lower()
        if (
            isinstance(err, ConnectionError)
            or name in ("OfflineModeIsEnabled", "LocalEntryNotFoundError")
            or "offline" in text
            or "couldn't reach" in text
            or "couldn't connect" in text
        ):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _offline_message(what: str, err: BaseException) -> str:
    from huggingface_hub import constants

    why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub is not reachable"
    return (
        f"{what} is not available offline ({why}: {one_line(err)}); use a local checkpoint / the "
        "local tasks, or run with network access"
    )


def _yaml_task_name(path: Path) -> str:
    """The `task:` of a task YAML (lm-eval's `!function` and other tags are skipped, not resolved)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        data = yaml.load(path.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as err:
        raise UserError(f"Task file {path} is not valid YAML: {one_line(err)}") from err
    name = data.get("task") or data.get("group") if isinstance(data, dict) else None
    if not isinstance(name, str):
        raise UserError(f"Task file {path} names no `task:`; add one or pass the task by name")
    return name


def resolve_tasks(tasks: list[str], include_paths: list[str | Path]) -> tuple[list[str], list[Path]]:
    """Task names plus the include paths (local tasks first); a task given as a YAML path becomes its name
    and its directory an include path. UserError for a missing path."""
    paths = [LOCAL_TASKS_DIR]
    for p in include_paths:
        p = Path(p)
        if not p.exists():
            raise UserError(f"--include-path {p} does not exist; give a directory (or file) of task YAMLs")
        paths.append(p.resolve())
    names = []
    for t in tasks:
        if t.endswith((".yaml", ".yml")):
            path = Path(t)
            if not path.is_file():
                raise UserError(f"Task file {t} does not exist; check the path in --tasks")
            names.append(_yaml_task_name(path))
            paths.append(path.resolve().parent)
        else:
            names.append(t)
    return names, list(dict.fromkeys(paths))


def task_manager(names: list[str], include_paths: list[Path]):
    """A TaskManager over the include paths only if they have every task; else with lm-eval's own tasks.
    UserError naming an unknown task."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=[str(p) for p in include_paths], include_defaults=False)
    if all(n in tm.all_tasks for n in names):
        return tm
    local = sorted(tm.all_tasks)
    tm = TaskManager(include_path=[str(p) for p in include_paths])
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        raise UserError(
            f"Unknown task(s) {unknown}; local tasks: {', '.join(local)} (or any lm-eval task name, or a "
            "task YAML path / --include-path DIR)"
        )
    return tm


def _check_task_data(names: list[str], manager) -> None:
    """Load every task's data once (the datasets cache keeps it); an unreachable hub dataset -> one line."""
    from lm_eval.tasks import get_task_dict

    try:
        get_task_dict(names, manager)
    except Exception as err:
        if _is_offline_error(err):
            raise UserError(_offline_message(f"Task data for {names}", err)) from err
        raise UserError(f"Could not load the task(s) {names}: {one_line(err)}") from err


def evaluate_model(
    lm_model,
    tokenizer,
    tasks: list[str],
    *,
    include_paths: list[str | Path] = (),
    batch_size: int = 8,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    seed: int = 1234,
    log_samples: bool = False,
    bootstrap_iters: int = 1000,
    manager=None,
) -> dict:
    """`lm_eval.simple_evaluate` of an already loaded causal LM; returns lm-eval's result dict."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    names, paths = resolve_tasks(list(tasks), list(include_paths))
    tm = manager if manager is not None else task_manager(names, paths)
    lm = HFLM(pretrained=lm_model, tokenizer=tokenizer, batch_size=batch_size)
    try:
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=tm,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=log_samples,
            bootstrap_iters=bootstrap_iters,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except Exception as err:
        if _is_offline_error(err):
            raise UserError(_offline_message(f"Task data for {names}", err)) from err
        raise


def validate(
    *,
    model,
    dtype: str,
    attn_implementation: str | None,
    batch_size: int,
    limit: int | float | None,
    num_fewshot: int | None,
    output: str | Path | None,
    seed: int = 1234,
) -> str:
    """The options checked before any work (nothing loaded or written): UserError naming the first bad one.
    Returns the resolved model path (or hub id)."""
    loading.parse_dtype(dtype)
    loading.check_attn_implementation(attn_implementation)
    check_number("--batch-size", batch_size, minimum=1, inclusive=True, integer=True)
    check_number("--limit", limit)
    if limit is not None and limit > 1 and not float(limit).is_integer():
        raise UserError(f"--limit must be a whole number of items or a fraction below 1, got {limit}")
    check_number("--num-fewshot", num_fewshot, inclusive=True, integer=True)
    check_seed(seed)
    if output is not None:
        check_output(None, output, overwrite=True, kind="json")
    model_path = str(loading.resolve_model(model))
    if Path(model_path).is_dir():
        config = loading.check_checkpoint_complete(model_path)
        loading.check_tokenizer_fits(loading.load_tokenizer(model_path), loading.vocab_size(config))
    return model_path


def run(
    *,
    model: str | Path | None = None,
    tasks: list[str] = DEFAULT_TASKS,
    include_paths: list[str | Path] = (),
    attn_implementation: str | None = None,
    dtype: str = "float32",
    batch_size: int = 8,
    device: str = DEFAULT_DEVICE,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    seed: int = 1234,
    trust_remote_code: bool = False,
    log_samples: bool = False,
    output: str | Path | None = None,
) -> dict:
    """Load the checkpoint (after `import hf_attn`), run lm-eval, return (and write) the JSON record."""
    model_path = validate(
        model=model,
        dtype=dtype,
        attn_implementation=attn_implementation,
        batch_size=batch_size,
        limit=limit,
        num_fewshot=num_fewshot,
        output=output,
        seed=seed,
    )
    torch_dtype = loading.parse_dtype(dtype)
    target = resolve_device(device)  # auto: CUDA where torch sees it, else the CPU
    names, paths = resolve_tasks(list(tasks), list(include_paths))  # check the tasks before loading
    manager = task_manager(names, paths)
    _check_task_data(names, manager)  # before loading weights: offline hub datasets fail here
    try:
        lm_model = loading.load_causal_lm(
            model_path,
            attn_implementation=attn_implementation,
            dtype=torch_dtype,
            trust_remote_code=trust_remote_code,
        )
        tokenizer = loading.load_tokenizer(model_path)
    except (ValueError, OSError) as err:
        if not Path(model_path).exists() and _is_offline_error(err):
            raise UserError(_offline_message(f"Model {model_path}", err)) from err
        raise
    announce_device(target)  # every input checked: the command's one line saying where it runs
    lm_model.to(target)
    start = time.perf_counter()
    results = evaluate_model(
        lm_model,
        tokenizer,
        names,
        include_paths=paths,
        batch_size=batch_size,
        limit=limit,
        num_fewshot=num_fewshot,
        seed=seed,
        log_samples=log_samples,
        manager=manager,
    )
    record = {
        "model": model_path,
        "checkpoint_hash": loading.model_hash(model_path),
        "model_type": lm_model.config.model_type,
        "attn_implementation": lm_model.config._attn_implementation,
        "dtype": loading.dtype_name(torch_dtype),
        "tasks": names,
        "limit": limit,
        "batch_size": batch_size,
        "device": str(target),
        "seconds": time.perf_counter() - start,
        "versions": {**loading.library_versions(), "lm_eval": results.get("lm_eval_version")},
        "results": results["results"],
        "lm_eval": {k: v for k, v in results.items() if k != "results"},
    }
    if output is not None:
        write_json(output, record, prog=PROG)
    return record


def summary_lines(record: dict) -> list[str]:
    lines = []
    for task, metrics in record["results"].items():
        parts = []
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(key.replace(",", "_stderr,", 1))
            err = f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else ""
            parts.append(f"{key.split(',')[0]} {value:.4f}{err}")
        lines.append(f"{task}: " + ", ".join(parts) + f" ({metrics.get('sample_len', '?')} items)")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="checkpoint directory or hub id (default: the embedded SmolLM2)"
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        default=list(DEFAULT_TASKS),
        help="task names (comma or space separated) or task YAML paths (default: the two local tasks)",
    )
    p.add_argument("--include-path", nargs="+", default=[], metavar="DIR", help="more task YAML directories")
    p.add_argument("--attn-implementation", default=None, help="eager, sdpa, hf_attn_grouped, ...")
    dtypes = list(loading.DTYPES)
    p.add_argument("--load-dtype", default="float32", choices=dtypes, help="dtype the weights load in")
    add_deprecated_alias(p, "--dtype", new_flag="--load-dtype", dest="load_dtype", choices=dtypes)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default=DEFAULT_DEVICE, help=f"{DEVICE_HELP} (also cuda:N)")
    p.add_argument("--limit", type=float, default=None, help="first N items per task (or a fraction < 1)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-samples", action="store_true", help="keep every item's scores in the output")
    p.add_argument(
        "--output",
        default=None,
        help="write the JSON record here (replaces only a JSON record hf-attn wrote; default: none)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tasks = [t for arg in args.tasks for t in arg.split(",") if t]
    limit = args.limit
    if limit is not None and limit >= 1 and float(limit).is_integer():
        limit = int(limit)

    def evaluate() -> None:
        record = run(
            model=args.model,
            tasks=tasks,
            include_paths=args.include_path,
            attn_implementation=args.attn_implementation,
            dtype=args.load_dtype,
            batch_size=args.batch_size,
            device=args.device,
            limit=limit,
            num_fewshot=args.num_fewshot,
            seed=args.seed,
            trust_remote_code=args.trust_remote_code,
            log_samples=args.log_samples,
            output=args.output,
        )
        for line in summary_lines(record):
            print(line)
        print(
            f"{record['model']} | {record['model_type']} {record['attn_implementation']} {record['dtype']} | "
            f"{record['seconds']:.1f} s"
        )

    return run_command(PROG, evaluate)


if __name__ == "__main__":
    raise SystemExit(main())
