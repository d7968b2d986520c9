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

import dataclasses
import time
from pathlib import Path

from hf_attn.tooling import loading, task_data
from hf_attn.tooling.cli import (
    ArgumentParser,
    add_settings_arguments,
    run_command,
    setting,
    settings_from_args,
)
from hf_attn.tooling.devices import DEFAULT_DEVICE, DEVICE_HELP, announce_device, resolve_device
from hf_attn.tooling.errors import UserError, check_number, check_seed, one_line
from hf_attn.tooling.files import check_output, write_json

PROG = "hf-attn harness"

LOCAL_TASKS_DIR = Path(__file__).resolve().parent / "tasks"


@dataclasses.dataclass(frozen=True)
class HarnessSettings:
    """What `run` evaluates and how; `hf-attn harness`'s options are built from these fields."""

    model: str | None = setting(None, help="checkpoint directory or hub id (default: the embedded SmolLM2)")
    tasks: list[str] = setting(
        list(task_data.TASKS),
        help="task names (comma or space separated) or task YAML paths (default: the two local tasks)",
    )
    include_paths: list[str] = setting(
        [], help="more task YAML directories", flag="--include-path", metavar="DIR"
    )
    attn_implementation: str | None = setting(None, help="eager, sdpa, hf_attn_grouped, ...")
    load_dtype: str = setting(
        "float32",
        help="dtype the weights load in",
        choices=list(loading.DTYPES),
        deprecated_flags=("--dtype",),
    )
    batch_size: int = setting(8)
    device: str = setting(DEFAULT_DEVICE, help=f"{DEVICE_HELP} (also cuda:N)")
    limit: float | None = setting(None, help="first N items per task (or a fraction < 1)")
    num_fewshot: int | None = setting(None)
    seed: int = setting(1234)
    trust_remote_code: bool = setting(False)
    log_samples: bool = setting(False, help="keep every item's scores in the output")
    output: str | None = setting(
        None, help="write the JSON record here (replaces only a JSON record hf-attn wrote; default: none)"
    )


_OFFLINE_ERRORS = ("OfflineModeIsEnabled", "LocalEntryNotFoundError")
_OFFLINE_TEXTS = ("offline", "couldn't reach", "couldn't connect")


def _raise_if_offline(what: str, err: BaseException) -> None:
    """UserError saying `what` is not available offline, if `err` (or anything in its chain, 16 links at
    most) says the hub could not be reached."""
    cause = err
    for _ in range(16):
        if cause is None:
            return
        offline = isinstance(cause, ConnectionError) or type(cause).__name__ in _OFFLINE_ERRORS
        if offline or any(text in str(cause).lower() for text in _OFFLINE_TEXTS):
            break
        cause = cause.__cause__ or cause.__context__
    else:
        return
    from huggingface_hub import constants

    why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub is not reachable"
    raise UserError(
        f"{what} is not available offline ({why}: {one_line(err)}); use a local checkpoint / the "
        "local tasks, or run with network access"
    ) from err


def _yaml_task_name(path: Path) -> str:
    """The `task:` of a task YAML (lm-eval's `!function` and other tags are skipped, not resolved)."""
    import yaml

    loader = type("_Loader", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        data = yaml.load(path.read_text(), Loader=loader) or {}
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
        _raise_if_offline(f"Task data for {names}", err)
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
    seeds = dict.fromkeys(
        ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), seed
    )
    try:
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=tm,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=log_samples,
            bootstrap_iters=bootstrap_iters,
            **seeds,
        )
    except Exception as err:
        _raise_if_offline(f"Task data for {names}", err)
        raise


def validate(settings: HarnessSettings) -> str:
    """The options checked before any work (nothing loaded or written): UserError naming the first bad one.
    Returns the resolved model path (or hub id)."""
    s = settings
    loading.parse_dtype(s.load_dtype)
    loading.check_attn_implementation(s.attn_implementation)
    check_number("--batch-size", s.batch_size, minimum=1, inclusive=True, integer=True)
    check_number("--limit", s.limit)
    if s.limit is not None and s.limit > 1 and not float(s.limit).is_integer():
        raise UserError(f"--limit must be a whole number of items or a fraction below 1, got {s.limit}")
    check_number("--num-fewshot", s.num_fewshot, inclusive=True, integer=True)
    check_seed(s.seed)
    if s.output is not None:
        check_output(None, s.output, overwrite=True, kind="json")
    model_path = str(loading.resolve_model(s.model))
    if Path(model_path).is_dir():
        config = loading.check_checkpoint_complete(model_path)
        loading.check_tokenizer_fits(loading.load_tokenizer(model_path), loading.vocab_size(config))
    return model_path


def run(settings: HarnessSettings) -> dict:
    """Load the checkpoint (after `import hf_attn`), run lm-eval, return (and write) the JSON record."""
    s = settings
    model_path = validate(s)
    torch_dtype = loading.parse_dtype(s.load_dtype)
    target = resolve_device(s.device)  # auto: CUDA where torch sees it, else the CPU
    names, paths = resolve_tasks(list(s.tasks), list(s.include_paths))  # check the tasks before loading
    manager = task_manager(names, paths)
    _check_task_data(names, manager)  # before loading weights: offline hub datasets fail here
    try:
        lm_model = loading.load_causal_lm(
            model_path,
            attn_implementation=s.attn_implementation,
            dtype=torch_dtype,
            trust_remote_code=s.trust_remote_code,
        )
        tokenizer = loading.load_tokenizer(model_path)
    except (ValueError, OSError) as err:
        if not Path(model_path).exists():
            _raise_if_offline(f"Model {model_path}", err)
        raise
    announce_device(target)  # every input checked: the command's one line saying where it runs
    lm_model.to(target)
    start = time.perf_counter()
    results = evaluate_model(
        lm_model,
        tokenizer,
        names,
        batch_size=s.batch_size,
        limit=s.limit,
        num_fewshot=s.num_fewshot,
        seed=s.seed,
        log_samples=s.log_samples,
        manager=manager,  # over the include paths
    )
    record = {
        "model": model_path,
        "checkpoint_hash": loading.model_hash(model_path),
        "model_type": lm_model.config.model_type,
        "attn_implementation": lm_model.config._attn_implementation,
        "dtype": loading.dtype_name(torch_dtype),
        "tasks": names,
        "limit": s.limit,
        "batch_size": s.batch_size,
        "device": str(target),
        "seconds": time.perf_counter() - start,
        "versions": {**loading.library_versions(), "lm_eval": results.get("lm_eval_version")},
        "results": results["results"],
        "lm_eval": {k: v for k, v in results.items() if k != "results"},
    }
    if s.output is not None:
        write_json(s.output, record, prog=PROG)
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


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_settings_arguments(parser, HarnessSettings)
    args = parser.parse_args(argv)
    limit = args.limit
    if limit is not None and limit >= 1 and float(limit).is_integer():
        limit = int(limit)
    tasks = [t for arg in args.tasks for t in arg.split(",") if t]
    settings = settings_from_args(HarnessSettings, args, tasks=tasks, limit=limit)

    def evaluate() -> None:
        record = run(settings)
        for line in summary_lines(record):
            print(line)
        print(
            f"{record['model']} | {record['model_type']} {record['attn_implementation']} {record['dtype']} | "
            f"{record['seconds']:.1f} s"
        )

    return run_command(PROG, evaluate)


if __name__ == "__main__":
    raise SystemExit(main())
