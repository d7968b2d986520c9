"""Decode speed of a `llama_mla` model: absorbed vs expanded attention path, and the source GQA model (sdpa).

Protocol: the decode protocol of `eval/bench/decoding.py` at batch 1, fp32, `--threads` torch threads for
decode (default 1: on a shared machine OpenMP barriers make multi-threaded small ops wait for preempted
threads, 1000x slower here). For each model one context of max(contexts) corpus token ids (random ids with
`--random-weights`, which has no tokenizer) is prefilled once in chunks (not timed, all cores); for each
context length L a fresh cache holding its first L tokens is decoded from the corpus token at L for `warmup`
untimed + `new_tokens` timed steps; tokens/s = 1 / median step time (positions may run past
max_position_embeddings by warmup + new_tokens: speed does not depend on it). The load average is recorded
beside the numbers, since the machine may be shared.

Without `--model`, the MLA model is built here with the source's dimensions and non-attention weights plus
random MLA attention weights of the requested ranks (`--kv-lora-rank`, `--rope-pairs`): decode cost depends on
shapes only. `--random-weights` needs only the source's config.json (random weights everywhere).

    python -m benchmarks.mla_decode [--model MLA_DIR] [--source SRC_DIR] [--contexts 1024 4096 8192]
        [--new-tokens 32] [--kv-lora-rank 64] [--rope-pairs 8] [--threads 1] [--device auto|cpu|cuda[:N]]
        [--random-weights] [--output results.json]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_attn.eval.bench import decoding
from hf_attn.eval.kv_cache import numbers_per_token_per_layer
from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM
from hf_attn.models.llama_mla.configuration_llama_mla import SOURCE_MODEL_TYPES
from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.devices import DEFAULT_DEVICE, DEVICE_HELP, announce_device, resolve_device
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import check_output, write_json
from hf_attn.tooling.loading import (
    check_checkpoint_complete,
    library_versions,
    load_causal_lm,
    load_config,
    resolve_model,
)
from hf_attn.tooling.tables import markdown_table

PROG = "python -m benchmarks.mla_decode"
WRITER = "hf-attn benchmarks.mla_decode"  # its JSON's written_by: an hf-attn output (the output guard)

_SOURCE_FIELDS_DROP = ("model_type", "architectures", "transformers_version", "auto_map", "dtype", "hf_attn")
VARIANTS = ("absorbed", "expanded", "source GQA (sdpa)")


def load_source(source: str | Path, *, random_weights: bool = False, seed: int = 0):
    """The source GQA model under sdpa: its checkpoint, or random weights from its config alone."""
    if not random_weights:
        return load_causal_lm(source, attn_implementation="sdpa")
    config = load_config(source)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def check_source_config(cfg, *, kv_lora_rank: int, rope_pairs: int) -> None:
    """UserError unless `cfg` is a source model type llama_mla takes and the ranks fit its heads."""
    if cfg.model_type not in SOURCE_MODEL_TYPES:
        raise UserError(
            f"--source must be a Llama / Mistral / Qwen2 model, got model type {cfg.model_type!r}"
        )
    check_number("--kv-lora-rank", kv_lora_rank, minimum=1, inclusive=True, integer=True)
    half = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    half //= 2
    if not isinstance(rope_pairs, int) or isinstance(rope_pairs, bool) or not 0 <= rope_pairs <= half:
        raise UserError(f"--rope-pairs must be an integer in [0, {half}] (head_dim / 2), got {rope_pairs!r}")


def check_run(
    *,
    model,
    source: str,
    contexts,
    new_tokens,
    warmup,
    kv_lora_rank,
    rope_pairs,
    device,
    random_weights,
    prefill_threads,
) -> None:
    """Every option and both checkpoints' files checked before any weight is loaded: UserError naming the
    flag, the value and the fix."""
    if not contexts:
        raise UserError("--contexts needs at least one context length")
    for value in contexts:
        check_number("--contexts", value, minimum=1, inclusive=True, integer=True)
    check_number("--new-tokens", new_tokens, minimum=1, inclusive=True, integer=True)
    check_number("--warmup", warmup, minimum=0, inclusive=True, integer=True)
    check_number("--prefill-threads", prefill_threads, minimum=1, inclusive=True, integer=True)
    resolve_device(device)  # auto, cpu, cuda[:N] (a CUDA device torch sees)
    cfg = load_config(source) if random_weights else check_checkpoint_complete(source)
    if model is None:
        check_source_config(cfg, kv_lora_rank=kv_lora_rank, rope_pairs=rope_pairs)
    elif check_checkpoint_complete(model).model_type != "llama_mla":
        raise UserError(
            f"--model {model} is not a llama_mla checkpoint; convert it with `hf-attn convert mla`"
        )


def random_mla_like(src, *, kv_lora_rank: int, rope_pairs: int, seed: int = 0) -> LlamaMLAForCausalLM:
    """A llama_mla model with `src`'s config and non-attention weights, random MLA attention weights."""
    cfg = src.config
    check_source_config(cfg, kv_lora_rank=kv_lora_rank, rope_pairs=rope_pairs)
    fields = {k: v for k, v in cfg.to_dict().items() if k not in _SOURCE_FIELDS_DROP}
    qwen2 = cfg.model_type == "qwen2"
    mla_cfg = LlamaMLAConfig(
        **fields,
        kv_lora_rank=kv_lora_rank,
        rope_pairs=rope_pairs,
        qkv_bias=qwen2 or bool(getattr(cfg, "attention_bias", False)),
        o_bias=not qwen2 and bool(getattr(cfg, "attention_bias", False)),
        source_model_type=cfg.model_type,
    )
    torch.manual_seed(seed)
    mla = LlamaMLAForCausalLM(mla_cfg)
    shared = {k: v for k, v in src.state_dict().items() if ".self_attn." not in k}
    missing, unexpected = mla.load_state_dict(shared, strict=False)
    assert not unexpected and all(".self_attn." in k for k in missing), (missing, unexpected)
    mla.set_attn_implementation("sdpa")
    return mla.eval()


def cache_prefix(cache: DynamicCache, length: int, config) -> DynamicCache:
    """A new DynamicCache holding copies of the first `length` tokens of `cache`."""
    out = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone(), i)
    return out


def decode_tokens_per_second(
    model, cache: DynamicCache, token: torch.Tensor, *, new_tokens: int, warmup: int = decoding.WARMUP
) -> float:
    """Decode tokens/s from `token` (1, 1) on `cache` under the protocol of `eval/bench/decoding.py`."""
    return decoding.time_decode(model, cache, token, steps=new_tokens, warmup=warmup).tokens_per_second


def kv_numbers_per_token(config) -> int:
    """Cached numbers per token summed over layers (fp32 bytes = 4x)."""
    return numbers_per_token_per_layer(config) * config.num_hidden_layers


def run(
    *,
    model: str | Path | None = None,
    source: str | Path | None = None,
    contexts: tuple[int, ...] = (1024, 4096, 8192),
    new_tokens: int = 32,
    warmup: int = 2,
    kv_lora_rank: int = 64,
    rope_pairs: int = 8,
    device: str = DEFAULT_DEVICE,
    random_weights: bool = False,
    prefill_threads: int | None = None,
    seed: int = 0,
    on_row: Callable[[dict], None] | None = None,
) -> dict:
    """Measure decode tokens/s; returns the record (rows: context x variant; `on_row` sees each row)."""
    source = str(resolve_model(source))
    check_run(model=model, source=source, contexts=contexts, new_tokens=new_tokens, warmup=warmup,
              kv_lora_rank=kv_lora_rank, rope_pairs=rope_pairs, device=device, random_weights=random_weights,
              prefill_threads=prefill_threads)  # fmt: skip
    device = resolve_device(device)
    src = load_source(source, random_weights=random_weights, seed=seed)
    if model is None:
        mla = random_mla_like(src, kv_lora_rank=kv_lora_rank, rope_pairs=rope_pairs, seed=seed)
        mla_desc = f"random MLA attention on {Path(source).name} (d_c={kv_lora_rank}, r={rope_pairs})"
    else:
        mla = load_causal_lm(model, attn_implementation="sdpa")
        mla_desc = str(model)
    mla, src = mla.to(device), src.to(device)
    announce_device(device)  # every input checked: the command's one line saying where it runs
    n_ids = max(contexts) + 1  # the token at L starts the decode of context L
    if random_weights:  # no tokenizer needed: random ids
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, src.config.vocab_size, (1, n_ids), generator=generator)
    else:
        ids = decoding.prompt_rows(decoding.corpus_ids(source), 1, n_ids)  # (1, max L + 1)
    ids = ids.to(device)
    load_before = os.getloadavg()
    decode_threads = torch.get_num_threads()
    torch.set_num_threads(prefill_threads or os.cpu_count() or 1)  # big matmuls: all cores
    prompt = ids[:, :-1]  # (1, max L)
    caches = {"mla": decoding.prefill(mla, prompt)[0], "source": decoding.prefill(src, prompt)[0]}
    torch.set_num_threads(decode_threads)
    setups = dict(zip(VARIANTS, [(mla, "mla", "absorbed"), (mla, "mla", "expanded"), (src, "source", None)]))
    rows = []
    for length in contexts:
        for name, (lm, key, path) in setups.items():
            if path is not None:
                lm.config.mla_attention_path = path
            cache = cache_prefix(caches[key], length, lm.config)
            token = ids[:, length : length + 1]  # (1, 1): the corpus token after the context
            tps = decode_tokens_per_second(lm, cache, token, new_tokens=new_tokens, warmup=warmup)
            rows.append({"context": length, "variant": name, "tokens_per_s": tps})
            if on_row is not None:
                on_row(rows[-1])
    mla.config.mla_attention_path = "auto"
    return {
        "benchmark": "decode tokens/s, batch 1, fp32, greedy, 1 / median step time",
        "prompt_ids": "random" if random_weights else "corpus",
        "mla_model": mla_desc,
        "source_model": str(source) + (" (random weights)" if random_weights else ""),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "kv_numbers_per_token": {
            "mla": kv_numbers_per_token(mla.config),
            "source": kv_numbers_per_token(src.config),
        },
        "new_tokens": new_tokens,
        "warmup": warmup,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "versions": library_versions(),
        "rows": rows,
    }


def format_table(record: dict) -> str:
    """Markdown table: one row per context, tokens/s per variant, absorbed / expanded and / source."""
    by = {(r["context"], r["variant"]): r["tokens_per_s"] for r in record["rows"]}
    header = "context | absorbed tok/s | expanded tok/s | source GQA (sdpa) tok/s | absorbed / expanded"
    rows = []
    for c in sorted({r["context"] for r in record["rows"]}):
        a, e, s = (by[(c, v)] for v in VARIANTS)
        rows.append([c, f"{a:.1f}", f"{e:.1f}", f"{s:.1f}", f"{a / e:.2f}x", f"{a / s:.2f}x"])
    return markdown_table([*header.split(" | "), "absorbed / source"], rows, align="r" * 6)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="llama_mla checkpoint (default: built here, random MLA attention weights)")
    p.add_argument("--source", help="source GQA checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kv-lora-rank", type=int, default=64)
    p.add_argument("--rope-pairs", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see the protocol)")
    p.add_argument("--prefill-threads", type=int, help="torch threads for the untimed prefill (default: all)")
    p.add_argument("--device", default=DEFAULT_DEVICE, help=f"{DEVICE_HELP} (also cuda:N)")
    p.add_argument("--random-weights", action="store_true", help="random weights from the source's config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the record as JSON here")
    return p


def bench(args: argparse.Namespace) -> None:
    """The command's work: options and `--output` checked first, then the measurements, table and JSON."""
    check_number("--threads", args.threads, minimum=1, inclusive=True, integer=True)
    if args.output:
        check_output(None, args.output, overwrite=True, kind="json")
    torch.set_num_threads(args.threads)
    record = run(
        model=args.model,
        source=args.source,
        contexts=tuple(args.contexts),
        new_tokens=args.new_tokens,
        warmup=args.warmup,
        kv_lora_rank=args.kv_lora_rank,
        rope_pairs=args.rope_pairs,
        device=args.device,
        random_weights=args.random_weights,
        prefill_threads=args.prefill_threads,
        seed=args.seed,
        on_row=lambda r: print(
            f"context {r['context']:>6}  {r['variant']:<18} {r['tokens_per_s']:8.2f} tok/s", flush=True
        ),
    )
    print(format_table(record))
    load = record["load_average"]
    print(f"device {record['device']}, {record['threads']} threads, load average before/after: {load}")
    if args.output:
        write_json(args.output, record, prog=WRITER)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: bench(args))


if __name__ == "__main__":
    raise SystemExit(main())
