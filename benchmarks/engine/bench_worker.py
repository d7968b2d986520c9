"""One model in vLLM: its KV-cache capacity, batch throughput, decode step times and a decode profile.

Runs inside the engine's virtual environment (vLLM and hf_attn never share an interpreter), by path:

    .venv-engine/bin/python bench_worker.py SPEC.json RESULT.json

SPEC.json (written by `python -m benchmarks.engine`, `benchmarks/engine/bench.py`):
    model, dtype, kv_cache_bytes, max_model_len, max_num_seqs, max_num_batched_tokens (or null),
    rotary_workaround ("auto" | "on" | "off": worker.py's, for deepseek_v3 models only), enforce_eager,
    token_range [low, high), seed, and
    runs: a list of {"kind": "batch", "name", "num_requests", "prompt_len", "output_len"}
                 or {"kind": "decode", "name", "levels", "prompt_len", "horizon", "steps", "profile_steps",
                     "profile_at": concurrencies, or "max" = the highest level measured (also the
                     level used for one above it)}.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller), so each
`LLMEngine.step()` is exactly one scheduler step and one model execution, timed here and visible to the torch
profiler. Only the standard library, torch and vLLM are imported (and, by path, eval/engine/worker.py and
eval/engine/rotary_repro.py: the engine check's rotary workaround and the probe that decides it).
"""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

# the engine check's folder: its worker.py and rotary_repro.py
HERE = Path(__file__).resolve().parents[2] / "eval" / "engine"
NULL_BLOCKS = 1  # vllm/v1/core/block_pool.py: BlockPool.null_block, taken from the free queue at start


def prompts(count: int, length: int, *, token_range: list[int], seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn uniformly from token_range (the same for every model)."""
    rng = random.Random(seed)
    low, high = token_range
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]


def build_engine(spec: dict):
    """vllm.LLM for the spec's model with an explicit KV-cache size (the same bytes for every model)."""
    from vllm import LLM

    kwargs = dict(
        model=spec["model"],
        dtype=spec["dtype"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        enable_prefix_caching=False,
        enforce_eager=spec["enforce_eager"],
        skip_tokenizer_init=True,
        seed=spec["seed"],
    )
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    workaround = rotary_workaround(spec)
    if workaround:
        kwargs["compilation_config"] = dict(workaround)
    return LLM(**kwargs), bool(workaround)


def _sibling(name: str):
    """A module of the engine check (eval/engine), loaded by path (the folder is not put on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"_hf_attn_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rotary_workaround(spec: dict) -> dict | None:
    """The engine check's rotary workaround (worker.py) for an MLA model where vLLM's rotary op is wrong
    (rotary_repro.py decides under "auto"); None for other models or where the op is right."""
    mode = spec.get("rotary_workaround", "auto")
    with open(Path(spec["model"]) / "config.json") as f:
        mla = json.load(f)["model_type"] == "deepseek_v3"
    if mode == "off" or not mla:
        return None
    if mode == "auto" and not _sibling("rotary_repro").probe()["bug"]:
        return None
    return _sibling("worker").ROTARY_WORKAROUND


def capacity(llm) -> dict:
    """vLLM's own KV-cache figures: blocks, block size, tokens and max concurrency at max_model_len."""
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    return dict(
        num_blocks=cache.num_gpu_blocks,
        usable_blocks=cache.num_gpu_blocks - NULL_BLOCKS,
        block_size=cache.block_size,
        kv_cache_tokens=getattr(cache, "kv_cache_size_tokens", None),
        max_concurrency=getattr(cache, "kv_cache_max_concurrency", None),
        max_model_len=config.model_config.max_model_len,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        attention_backend=_backend_name(llm),
        device=str(config.device_config.device_type),
    )


def _backend_name(llm) -> str | None:
    """The attention backend class the model runner chose (None where it cannot be read)."""
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        groups = runner.attn_groups
        return groups[0][0].backend.get_name()
    except Exception:  # noqa: BLE001 - a report field, never a reason to fail
        return None


def _params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


class Tracker:
    """Adds requests, steps the engine and records per-step wall time and per-request token times."""

    def __init__(self, llm, token_lists: list[list[int]], max_tokens: int, tag: str):
        self.engine, self.tag, self.max_tokens = llm.llm_engine, tag, max_tokens
        self.ids: list[str] = []
        self.count: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.steps: list[dict] = []
        self.start = time.perf_counter()
        self.add(token_lists)

    def add(self, token_lists: list[list[int]]) -> None:
        """Submit one request per prompt (greedy, `max_tokens` new tokens, EOS ignored)."""
        for tokens in token_lists:
            rid = f"{self.tag}-{len(self.ids)}"
            self.ids.append(rid)
            self.count[rid] = 0
            self.engine.add_request(rid, {"prompt_token_ids": tokens}, _params(self.max_tokens))

    def all_started(self) -> bool:
        """Whether every request has produced a token (its prefill is done)."""
        return all(self.count[r] > 0 for r in self.ids)

    def step(self) -> dict:
        """One engine step: {seconds, tokens, decode (all requests past prefill before it)}."""
        decode = self.all_started()
        t0 = time.perf_counter()
        outputs = self.engine.step()
        t1 = time.perf_counter()
        tokens = 0
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            new = n - self.count[out.request_id]
            if new > 0:
                self.first.setdefault(out.request_id, t1)
                self.last[out.request_id] = t1
            tokens += new
            self.count[out.request_id] = n
        record = dict(seconds=t1 - t0, tokens=tokens, decode=decode)
        self.steps.append(record)
        return record

    def abort(self) -> None:
        self.engine.abort_request(self.ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()


def run_batch(llm, run: dict, spec: dict) -> dict:
    """All requests at once; the engine admits what its KV cache holds. Throughput and time per token."""
    tokens = prompts(
        run["num_requests"], run["prompt_len"], token_range=spec["token_range"], seed=spec["seed"]
    )
    tracker = Tracker(llm, tokens, run["output_len"], run["name"])
    while llm.llm_engine.has_unfinished_requests():
        tracker.step()
    wall = time.perf_counter() - tracker.start
    out_tokens = sum(tracker.count.values())
    tpots = [
        (tracker.last[r] - tracker.first[r]) / (tracker.count[r] - 1)
        for r in tracker.ids
        if tracker.count[r] > 1
    ]
    return dict(
        run,
        wall_s=wall,
        output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / wall,
        mean_tpot_ms=1e3 * statistics.fmean(tpots) if tpots else None,
        peak_decode_batch=max((s["tokens"] for s in tracker.steps if s["decode"] or s["tokens"]), default=0),
        steps=len(tracker.steps),
    )


def max_concurrency(llm, context: int) -> int:
    """The most sequences of `context` tokens the scheduler runs at once: max_num_seqs, and the KV blocks
    less the one vLLM's block pool keeps as its null block (never given to a request)."""
    cache = llm.llm_engine.vllm_config.cache_config
    cap = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    return min(cap, (cache.num_gpu_blocks - NULL_BLOCKS) // -(-context // cache.block_size))


def run_decode(llm, run: dict, spec: dict) -> dict:
    """Decode steps at rising concurrency: requests are added level by level (only the new ones prefill),
    and at each level `steps` pure decode steps (every running request past its prefill) are timed.

    Levels beyond what the KV cache holds at `horizon` tokens per sequence (the context reached by the last
    step) or beyond max_num_seqs are skipped; that maximum itself is measured when below the top level.
    """
    steps, profile_steps, horizon = run["steps"], run.get("profile_steps", 0), run["horizon"]
    most = max_concurrency(llm, horizon)
    levels = sorted(
        {c for c in run["levels"] if c <= most} | ({most} if most < max(run["levels"]) else set())
    )
    profile_at = {levels[-1] if c == "max" else min(c, levels[-1]) for c in run.get("profile_at", [])}
    max_tokens = horizon - run["prompt_len"]
    tokens = prompts(levels[-1], run["prompt_len"], token_range=spec["token_range"], seed=spec["seed"] + 1)
    tracker = Tracker(llm, [], max_tokens, run["name"])
    result = dict(run, levels_measured=[], max_concurrency_at_horizon=most, top_level=levels[-1])
    for c in levels:
        tracker.add(tokens[len(tracker.ids) : c])
        t0 = time.perf_counter()
        while not tracker.all_started():
            tracker.step()
        prefill_s = time.perf_counter() - t0
        timed = [tracker.step() for _ in range(steps)]
        seconds = [s["seconds"] for s in timed if s["tokens"] == c]
        level = dict(
            concurrency=c,
            mean_context=statistics.fmean(run["prompt_len"] + tracker.count[r] for r in tracker.ids),
            new_prefill_s=prefill_s,
            steps_timed=len(seconds),
            step_ms_median=1e3 * statistics.median(seconds) if seconds else None,
            step_ms_min=1e3 * min(seconds) if seconds else None,
            decode_tokens_per_s=c / statistics.median(seconds) if seconds else None,
        )
        if profile_steps and c in profile_at:
            level["profile"] = _profile(tracker, profile_steps)
        result["levels_measured"].append(level)
    tracker.abort()
    return result


def _profile(tracker: Tracker, steps: int, top: int = 12) -> dict:
    """Torch profiler over `steps` decode steps: the top ops by self time (CPU, or CUDA if present)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            tracker.step()
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1.0
    ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:top]
    return dict(
        device="cuda" if cuda else "cpu",
        steps=steps,
        total_ms_per_step=total / 1e3 / steps,
        top=[
            dict(
                op=e.key,
                ms_per_step=getattr(e, attr) / 1e3 / steps,
                share=getattr(e, attr) / total,
                calls=e.count,
            )
            for e in ranked
        ],
    )


RUNNERS = {"batch": run_batch, "decode": run_decode}


def main(argv: list[str]) -> int:
    spec_path, result_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm, workaround = build_engine(spec)
    result = dict(
        capacity=capacity(llm), load_s=time.perf_counter() - t0, rotary_workaround=workaround, runs=[]
    )
    for run in spec["runs"]:
        result["runs"].append(RUNNERS[run["kind"]](llm, run, spec))
        with open(result_path, "w") as f:  # after every run: an interrupted worker keeps what it measured
            json.dump(result, f, indent=1)
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
