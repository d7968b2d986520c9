"""The vLLM worker: runs INSIDE the engine environment (`make engine`: .venv-engine); never imported here.

    .venv-engine/bin/python eval/engine/worker.py REQUEST.json RESULT.json

Imports only the standard library, torch and vllm (plus `rotary_repro.py` beside it, by path). One launch
serves every job of the request in turn, each with all its prompts in one `LLM.generate` call (vLLM's
scheduler batches them: several sequences in the paged cache at once, prefill and decode both run).

REQUEST.json:

    {"rotary_workaround": "auto" | "on" | "off",       # auto: on iff the rotary reproduction shows the bug
     "jobs": [{"name": str, "model": DIR,
               "prompts": [[token ids], ...],          # token ids: no tokenizer is loaded
               "max_new_tokens": int,                  # greedy (temperature 0)
               "prompt_logprobs": bool,                # log-prob of every prompt token after the first
               "engine_args": {...}}]}                 # extra keyword arguments of vllm.LLM (dtype, ...)

RESULT.json (written atomically when every job has run):

    {"vllm": version, "torch": version, "rotary_probe": {...} | null, "rotary_workaround": bool,
     "compilation_config": {...},
     "jobs": {name: {"engine_args": {...}, "load_seconds": s, "generate_seconds": s,
                     "outputs": [{"tokens": [ids], "logprobs": [lp of each generated token],
                                  "prompt_logprobs": [null, lp of prompt token 1, ...] | null}]}}}

Exit status 0 when RESULT.json was written; anything else is on stderr.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# rotary_embedding as a custom op on CPU mis-rotates the MLA query (rotary_repro.py); vLLM's native
# PyTorch rotary is the same math
ROTARY_WORKAROUND = {"custom_ops": ["-rotary_embedding"]}
DEFAULT_ENGINE_ARGS = {"enforce_eager": True, "skip_tokenizer_init": True, "seed": 0}


def _rotary_probe() -> dict:
    """rotary_repro.probe(), loaded by path (the script's folder is not put on sys.path)."""
    spec = importlib.util.spec_from_file_location("_hf_attn_rotary_repro", HERE / "rotary_repro.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.probe()


def _chosen(logprobs: dict | None, token: int) -> float | None:
    """The log-prob vLLM reports for `token` (a {token id: Logprob} entry), None where there is none."""
    if not logprobs or token not in logprobs:
        return None
    return float(logprobs[token].logprob)


def _output(request_output) -> dict:
    completion = request_output.outputs[0]
    tokens = list(completion.token_ids)
    steps = completion.logprobs or [None] * len(tokens)
    prompt = request_output.prompt_token_ids
    prompt_lp = request_output.prompt_logprobs
    return {
        "tokens": tokens,
        "logprobs": [_chosen(step, t) for step, t in zip(steps, tokens)],
        "prompt_logprobs": None
        if prompt_lp is None
        else [None] + [_chosen(step, t) for step, t in zip(prompt_lp[1:], prompt[1:])],
    }


def run_job(job: dict, compilation_config: dict) -> dict:
    """Load one model, generate for all its prompts in one call, free the engine."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_args = {
        **DEFAULT_ENGINE_ARGS,
        "max_num_seqs": max(1, len(job["prompts"])),
        **job.get("engine_args", {}),
    }
    if compilation_config:
        engine_args["compilation_config"] = compilation_config
    start = time.perf_counter()
    llm = LLM(model=job["model"], **engine_args)
    loaded = time.perf_counter()
    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(job["max_new_tokens"]),
        logprobs=0,
        prompt_logprobs=0 if job.get("prompt_logprobs", True) else None,
        ignore_eos=True,
        detokenize=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in job["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    done = time.perf_counter()
    del llm
    gc.collect()
    return {
        "engine_args": {k: v for k, v in engine_args.items() if k != "compilation_config"},
        "load_seconds": loaded - start,
        "generate_seconds": done - loaded,
        "outputs": [_output(o) for o in outputs],
    }


def main(request_path: str, result_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    import torch
    import vllm

    mode = request.get("rotary_workaround", "auto")  # auto, on or off: checked by check.engine_check_many
    probe = _rotary_probe() if mode == "auto" else None
    workaround = mode == "on" or bool(probe and probe["bug"])
    compilation_config = dict(ROTARY_WORKAROUND) if workaround else {}
    result = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "rotary_probe": probe,
        "rotary_workaround": workaround,
        "compilation_config": compilation_config,
        "jobs": {job["name"]: run_job(job, compilation_config) for job in request["jobs"]},
    }
    tmp = Path(result_path).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(result_path)
    return 0


if __name__ == "__main__":
    if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
        sys.path.pop(0)  # this folder's other modules must not shadow anything vllm imports
    if len(sys.argv) != 3:
        print("usage: python worker.py REQUEST.json RESULT.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
