"""Export a `llama_mla` checkpoint as a dense DeepSeek-V3 (`model_type: deepseek_v3`) checkpoint, exactly.

    hf-attn export --to deepseek_v3 --model MLA_DIR --output DIR [--engine-dims native|576|512|320]
        [--latent-norm-eps-for transformers|engines] [--max-position-embeddings N] [--dtype ...] [--overwrite]

The output loads with vanilla transformers (`AutoModelForCausalLM.from_pretrained(DIR)`, no hf_attn, no
trust_remote_code) and, by its field and tensor names, with vLLM's and SGLang's DeepSeek-V2/V3 loaders
(docs/deepseek-export.md lists what they read). What DeepSeek cannot represent exactly is refused with the
reason and the conversion option that avoids it (exit status 2, nothing written): never an approximate export.

The source must be the DeepSeek layout of llama_mla: `rope_layout="shared"` (or per_head with Hkv == 1, the
same model) and `latent_norm=True`. Notation per layer: E hidden, Hq / Hkv query / KV heads, G = Hq / Hkv,
d head_dim, r kept RoPE pairs of the one shared RoPE key, dn = d - 2r, d_c latent width; exported:
D = kv_lora_rank (d_c, or the size named by --engine-dims minus 64), W RoPE slots (R = 2W =
qk_rope_head_dim). Per layer:

    q_proj             (Hq (dn + R), E)  head h: [q nope rows (dn) ; q_pe (R)] * sqrt((dn + R) / d)
    kv_a_proj_with_mqa (D + R, E)        [alpha * kv_down_proj (d_c) ; zeros (D - d_c) ; k_pe (R)]
    kv_a_layernorm     (D,)              [latent_norm.weight * sqrt(d_c / D) ; zeros (D - d_c)]
    kv_b_proj          (Hq (dn + d), D)  head h: [k_up rows of its KV group g = h // G (dn) ;
                                                    v_up rows of g (d)], zero columns past d_c
    o_proj             (E, Hq d)         unchanged (v_head_dim = d); embeddings, norms, MLPs: unchanged

docs/deepseek-export.md (section 3) says why each step is exact: the softmax scale folded into the query rows,
the kept RoPE pairs placed in interleaved slots of one geometric frequency sequence, the latent norm's padding
and eps matched by alpha = sqrt(eps_target D / (eps_source d_c)), tied embeddings written untied too, and the
MoE fields of a dense model.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from hf_attn.conversion.checkpoint import io as ckpt
from hf_attn.conversion.checkpoint.shards import ShardedWriter
from hf_attn.conversion.export.engine_dims import VLLM_VERSION_READ, accepting_backends
from hf_attn.conversion.export.plan import (
    LATENT_NORM_EPS_TARGETS,
    ExportPlan,
    deepseek_config,
    plan_export,
    refuse,
)
from hf_attn.conversion.specs import DEFAULT_MAX_SHARD_BYTES, ENGINE_DIMS, EXPORT_TARGETS, WriteSpec
from hf_attn.models.llama_mla import LlamaMLAConfig
from hf_attn.tooling.cli import ArgumentParser, add_deprecated_alias, add_settings_arguments, run_command
from hf_attn.tooling.errors import UserError, user_input
from hf_attn.tooling.files import atomic_directory, check_output, checkpoint_hash, write_json
from hf_attn.tooling.loading import parse_dtype, resolve_model

PROG = "hf-attn export"
GENERATION_CONFIG = "generation_config.json"
_TOP = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")  # outside the layers
_MLP = ("gate_proj", "up_proj", "down_proj")
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
_ATTN_SOURCES = {  # DeepSeek's attention tensor -> the llama_mla tensors it is computed from
    "q_proj.weight": ("q_proj.weight",),
    "kv_a_proj_with_mqa.weight": ("kv_down_proj.weight", "k_rope_proj.weight"),
    "kv_a_layernorm.weight": ("latent_norm.weight",),
    "kv_b_proj.weight": ("k_up_proj.weight", "v_up_proj.weight"),
    "o_proj.weight": ("o_proj.weight",),
}


def _attn(layer: int, name: str) -> str:
    return f"model.layers.{layer}.self_attn.{name}"


def _dense_shapes(plan: ExportPlan, config: LlamaMLAConfig) -> dict[str, tuple[int, ...]]:
    """The tensors alike in both layouts: embeddings, final norm, lm_head and every layer's norms and MLP."""
    E, V, F = plan.hidden_size, config.vocab_size, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,), "lm_head.weight": (V, E)}
    for i in range(plan.num_layers):
        pre = f"model.layers.{i}."
        shapes.update({pre + n + ".weight": (E,) for n in _LAYER_NORMS})
        shapes.update({pre + f"mlp.{n}.weight": (E, F) if n == "down_proj" else (F, E) for n in _MLP})
    return shapes


def source_shapes(plan: ExportPlan, config: LlamaMLAConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the source may hold (lm_head.weight only if untied; biases only if configured)."""
    E, Hq, Hkv, d, dc = plan.hidden_size, plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.latent_dim
    dn, rd, F = plan.nope_dim, 2 * plan.rope_pairs, config.intermediate_size
    shapes = _dense_shapes(plan, config)
    for i in range(plan.num_layers):
        if getattr(config, "mlp_bias", False):
            shapes.update({f"model.layers.{i}.mlp.{n}.bias": (E if n == "down_proj" else F,) for n in _MLP})
        attn = {
            "q_proj.weight": (Hq * d, E),
            "k_rope_proj.weight": (rd, E),
            "kv_down_proj.weight": (dc, E),
            "latent_norm.weight": (dc,),
            "k_up_proj.weight": (Hkv * dn, dc),
            "v_up_proj.weight": (Hkv * d, dc),
            "o_proj.weight": (E, Hq * d),
        }
        if config.qkv_bias:
            attn.update({"q_proj.bias": (Hq * d,), "k_rope_proj.bias": (rd,)})
            attn.update({"k_up_proj.bias": (Hkv * dn,), "v_up_proj.bias": (Hkv * d,)})
        if config.o_bias:
            attn["o_proj.bias"] = (E,)
        shapes.update({_attn(i, k): v for k, v in attn.items()})
    return shapes


def target_shapes(plan: ExportPlan, config: LlamaMLAConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the exported checkpoint and its shape."""
    E, Hq, d, D, R = plan.hidden_size, plan.num_heads, plan.head_dim, plan.kv_lora_rank, plan.qk_rope_head_dim
    dn = plan.nope_dim
    shapes = _dense_shapes(plan, config)
    for i in range(plan.num_layers):
        shapes[_attn(i, "q_proj.weight")] = (Hq * (dn + R), E)
        shapes[_attn(i, "kv_a_proj_with_mqa.weight")] = (D + R, E)
        shapes[_attn(i, "kv_a_layernorm.weight")] = (D,)
        shapes[_attn(i, "kv_b_proj.weight")] = (Hq * (dn + d), D)
        shapes[_attn(i, "o_proj.weight")] = (E, Hq * d)
    return shapes


def key_map(plan: ExportPlan, *, tied: bool) -> dict[str, tuple[str, ...]]:
    """Target tensor -> the source tensors it is computed from (the explicit key map)."""
    out = {n: (n,) for n in _TOP}
    if tied:
        out["lm_head.weight"] = ("model.embed_tokens.weight",)
    for i in range(plan.num_layers):
        pre = f"model.layers.{i}."
        for n in (*_LAYER_NORMS, *(f"mlp.{m}" for m in _MLP)):
            out[f"{pre}{n}.weight"] = (f"{pre}{n}.weight",)
        out.update({_attn(i, k): tuple(_attn(i, n) for n in names) for k, names in _ATTN_SOURCES.items()})
    return out


def rope_rows_to_slots(rows: torch.Tensor, *, plan: ExportPlan, layer: int) -> torch.Tensor:
    """llama_mla rope rows (2r, C), rotate-half over the kept pairs, -> DeepSeek interleaved rows (R, C):
    row 2k / 2k + 1 = the two rows of the pair in slot k, zeros for slots whose pair is not kept."""
    r = plan.rope_pairs
    assert rows.shape[0] == 2 * r, (tuple(rows.shape), r)
    out = rows.new_zeros(plan.qk_rope_head_dim, *rows.shape[1:])  # (R, C)
    for j, p in enumerate(plan.pairs[layer]):
        k = p // plan.rope_stride * plan.slots_per_stride  # source pair p -> RoPE slot (p / s) m
        out[2 * k] = rows[j]  # first of the pair (rotate-half: x1)
        out[2 * k + 1] = rows[r + j]  # second (x2)
    return out


@torch.inference_mode()
def export_attention(
    *, tensors: dict[str, torch.Tensor], plan: ExportPlan, layer: int
) -> dict[str, torch.Tensor]:
    """One layer's llama_mla attention weights (keys without the layer prefix, e.g. "q_proj.weight") ->
    DeepSeek's, computed in float64 and returned in the source dtype."""
    Hq, Hkv, d, E = plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.hidden_size
    dc, D, dn, rd = plan.latent_dim, plan.kv_lora_rank, plan.nope_dim, 2 * plan.rope_pairs
    dtype = tensors["q_proj.weight"].dtype
    t = {k: v.double() for k, v in tensors.items()}

    q = t["q_proj.weight"].view(Hq, d, E)  # (Hq, d, E), head rows [rope (2r) | nope (dn)]
    q_pe = [rope_rows_to_slots(q[h, :rd], plan=plan, layer=layer) for h in range(Hq)]  # Hq x (R, E)
    q_new = torch.cat([q[:, rd:], torch.stack(q_pe)], dim=1) * plan.query_scale  # (Hq, dn + R, E)

    latent = t["kv_down_proj.weight"] * plan.latent_scale  # (d_c, E)
    k_pe = rope_rows_to_slots(t["k_rope_proj.weight"], plan=plan, layer=layer)  # (R, E)
    kv_a = torch.cat([latent, latent.new_zeros(D - dc, E), k_pe])  # (D + R, E)

    gain = t["latent_norm.weight"] * plan.gain_scale  # (d_c,)
    norm = torch.cat([gain, gain.new_zeros(D - dc)])  # (D,)

    k_up = t["k_up_proj.weight"].view(Hkv, dn, dc)  # (Hkv, dn, d_c)
    v_up = t["v_up_proj.weight"].view(Hkv, d, dc)  # (Hkv, d, d_c)
    per_group = torch.cat([k_up, v_up], dim=1)  # (Hkv, dn + d, d_c)
    per_head = per_group.repeat_interleave(Hq // Hkv, dim=0)  # (Hq, dn + d, d_c): head h reads group h // G
    kv_b = torch.cat([per_head, per_head.new_zeros(Hq, dn + d, D - dc)], dim=2)  # (Hq, dn + d, D)

    out = {
        "q_proj.weight": q_new.reshape(Hq * (dn + plan.qk_rope_head_dim), E),
        "kv_a_proj_with_mqa.weight": kv_a,
        "kv_a_layernorm.weight": norm,
        "kv_b_proj.weight": kv_b.reshape(Hq * (dn + d), D),
        "o_proj.weight": t["o_proj.weight"],
    }
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def export_tensors(
    *,
    read: Callable[[str], torch.Tensor],
    names: set[str] | dict,
    plan: ExportPlan,
    config: LlamaMLAConfig,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the exported tensors (one layer's attention in memory at a time). `read(name)` returns a
    source tensor, `names` are the source's tensor names (a tied model's lm_head.weight, the embedding, is
    left out). Checks every source and every target shape, that
    every source tensor is used, and that every bias is zero (ValueError naming the tensor otherwise)."""
    src_shapes = source_shapes(plan, config)
    names = {n for n in names if not (config.tie_word_embeddings and n == "lm_head.weight")}
    tied = "lm_head.weight" not in names
    if tied and not config.tie_word_embeddings:
        raise UserError("lm_head.weight is missing from the checkpoint, which has tie_word_embeddings=False.")
    unexpected = sorted(set(names) - set(src_shapes))
    if unexpected:
        raise UserError(f"Unexpected tensors for a llama_mla checkpoint of this config: {unexpected[:5]}.")
    # the bias tensors of the source: DeepSeek (vLLM, SGLang) has none, so each must be all zeros
    biases = [n for n in src_shapes if n in names and n.endswith(".bias")]
    for name in biases:
        if read(name).abs().max().item() != 0:
            raise refuse(
                f"{name} is nonzero, and vLLM's and SGLang's DeepSeek attention and MLP have no biases",
                "export a source without q/k/v/o biases (or with all-zero ones)",
            )
    mapping, want = key_map(plan, tied=tied), target_shapes(plan, config)
    needed = {s for sources in mapping.values() for s in sources}
    missing = sorted(needed - set(names))
    if missing:
        raise UserError(f"Missing tensors in the llama_mla checkpoint: {missing[:5]}.")
    unused = sorted(set(names) - needed - set(biases))
    assert not unused, unused  # the key map consumes every source tensor

    def load(name: str) -> torch.Tensor:
        tensor = read(name)
        if tuple(tensor.shape) != src_shapes[name]:
            raise UserError(
                f"{name} has shape {list(tensor.shape)}, but its config implies {list(src_shapes[name])}."
            )
        return tensor

    def emit(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        assert tuple(tensor.shape) == want[name], (name, tuple(tensor.shape), want[name])
        return name, tensor

    for target in _TOP:
        yield emit(target, load(mapping[target][0]).clone())
    for i in range(plan.num_layers):
        for target, sources in mapping.items():
            if target.startswith(f"model.layers.{i}.") and ".self_attn." not in target:
                yield emit(target, load(sources[0]))
        prefix = _attn(i, "")
        attn = {
            s.removeprefix(prefix): load(s) for t, ss in mapping.items() if t.startswith(prefix) for s in ss
        }
        for key, tensor in export_attention(tensors=attn, plan=plan, layer=i).items():
            yield emit(prefix + key, tensor)


def deepseek_state_dict(
    *, state_dict: dict[str, torch.Tensor], plan: ExportPlan, config: LlamaMLAConfig
) -> dict[str, torch.Tensor]:
    """In-memory form of `export_tensors`: a llama_mla state dict -> the deepseek_v3 state dict."""
    names = {n for n in state_dict if not n.endswith("rope_dims")}
    return dict(export_tensors(read=state_dict.__getitem__, names=names, plan=plan, config=config))


def export_checkpoint(
    *,
    src: str | Path | None,
    dst: str | Path,
    to: str = "deepseek_v3",
    engine_dims: str = "native",
    latent_norm_eps_for: str = "transformers",
    max_position_embeddings: int | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `dst`: the llama_mla checkpoint `src` as an exact deepseek_v3 checkpoint (see the module doc)."""
    if to not in EXPORT_TARGETS:
        raise UserError(f"--to must be one of {EXPORT_TARGETS}, got {to!r}.")
    src_dir = resolve_model(src)
    raw = ckpt.read_config(src_dir)
    if raw.get("model_type") != "llama_mla":
        ckpt.check_supported(raw)  # a source no converter covers: name the feature, not only "convert first"
        raise UserError(
            f"--model {src_dir} has model_type {raw.get('model_type')!r}; the export reads llama_mla "
            "checkpoints: convert first with `hf-attn convert mla --layout deepseek`."
        )
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "transformers_version")}
    with user_input():  # llama_mla's own config checks and the export plan's (engine dims included)
        config = LlamaMLAConfig(**fields)
        plan = plan_export(
            config=config,
            engine_dims=engine_dims,
            latent_norm_eps_for=latent_norm_eps_for,
            max_position_embeddings=max_position_embeddings,
        )
    dst = check_output(src_dir, dst, overwrite=overwrite)
    cast = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    index = ckpt.checked_index(src_dir)  # would load completely, finite weights: before any output exists
    tensors = export_tensors(read=lambda n: ckpt.read_tensor(index[n]), names=index, plan=plan, config=config)
    first = next(tensors)  # raises the tensor checks (biases, shapes) before any output exists
    out_config = deepseek_config(config=config, plan=plan)
    if cast is not None:
        out_config["dtype"] = out_config["torch_dtype"] = ckpt.dtype_name(cast)
    record = ckpt.conversion_record(
        kind="export",
        source=src_dir,
        source_hash=checkpoint_hash(src_dir),
        settings={"to": to, "engine_dims": engine_dims, "latent_norm_eps_for": latent_norm_eps_for},
        rope={
            "stride": plan.rope_stride,
            "slots_per_stride": plan.slots_per_stride,
            "slots": plan.rope_slots,
            "source_pairs": [list(p) for p in plan.pairs],
        },
        cache_numbers_per_token_and_layer={  # d_c + 2r; what DeepSeek caches: kv_lora_rank + qk_rope_head_dim
            "source": plan.latent_dim + 2 * plan.rope_pairs,
            "export": plan.kv_lora_rank + plan.qk_rope_head_dim,
        },
    )
    out_config = ckpt.add_record(out_config, record)
    with atomic_directory(dst, overwrite=overwrite, kind="checkpoint") as tmp:
        with ShardedWriter(tmp, max_shard_bytes=max_shard_bytes) as writer:
            for name, tensor in itertools.chain([first], tensors):
                if cast is not None and tensor.is_floating_point():
                    tensor = tensor.to(cast)
                writer.add(name, tensor)
        ckpt.write_config(tmp, out_config)
        ckpt.copy_side_files(src_dir, tmp)
        for code in tmp.glob("*.py"):  # llama_mla's remote code: not part of a deepseek_v3 checkpoint
            code.unlink()
        if not (src_dir / GENERATION_CONFIG).exists():  # (else copied as a side file) a minimal one
            ids = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
            write_json(tmp / GENERATION_CONFIG, {k: v for k, v in ids.items() if v is not None})
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])  # one-line usage errors
    parser.add_argument("--to", choices=EXPORT_TARGETS, required=True, help="target format")
    parser.add_argument("--model", required=True, help="llama_mla checkpoint dir (DeepSeek layout)")
    parser.add_argument("--output", required=True, help="output checkpoint dir")
    parser.add_argument(
        "--engine-dims",
        choices=ENGINE_DIMS,
        default="native",
        help="kv_lora_rank + qk_rope_head_dim of the export: native (the conversion's own), or a size "
        "vLLM's MLA backends accept, zero-padded exactly to (size - 64) + 64: 576 (every backend, the only "
        f"one on CPU), 512 or 320 (FlashMLA, CUTLASS, FlashInfer; read from {VLLM_VERSION_READ}); padding "
        "costs cache",
    )
    add_deprecated_alias(
        parser, "--flashmla-dims", new_flag="--engine-dims 576", dest="engine_dims", nargs=0, const="576"
    )
    parser.add_argument(
        "--latent-norm-eps-for",
        choices=LATENT_NORM_EPS_TARGETS,
        default="transformers",
        help="whose kv_a_layernorm eps to match exactly: transformers (1e-6) or engines (vLLM, SGLang: "
        "rms_norm_eps); identical when rms_norm_eps is 1e-6",
    )
    parser.add_argument("--max-position-embeddings", type=int, default=None, help="lower the context limit")
    add_settings_arguments(parser, WriteSpec)  # --save-dtype (the old --dtype too) and --overwrite
    args = parser.parse_args(argv)

    def export_and_report() -> None:
        start = time.perf_counter()
        dst = export_checkpoint(
            src=args.model,
            dst=args.output,
            to=args.to,
            engine_dims=args.engine_dims,
            latent_norm_eps_for=args.latent_norm_eps_for,
            max_position_embeddings=args.max_position_embeddings,
            dtype=args.save_dtype,
            overwrite=args.overwrite,
        )
        config = ckpt.read_config(dst)
        out = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        src_n = ckpt.latest_record(config)["cache_numbers_per_token_and_layer"]["source"]
        pad = f" (+{out - src_n} zero-padded: {out / src_n:.2f}x the source's cache)" if out > src_n else ""
        cpu = accepting_backends(out, "cpu")
        serve = (
            f"vLLM on CPU: {', '.join(cpu)}" if cpu else "not servable by vLLM on CPU (--engine-dims 576 is)"
        )
        print(
            f"exported to deepseek_v3 in {time.perf_counter() - start:.1f} s: {dst}; cache per token and "
            f"layer {out} numbers = kv_lora_rank {config['kv_lora_rank']} + qk_rope_head_dim "
            f"{config['qk_rope_head_dim']}{pad}; MLA backends accepting it: "
            f"{', '.join(accepting_backends(out))} ({VLLM_VERSION_READ}; {serve})"
        )

    return run_command(PROG, export_and_report)


if __name__ == "__main__":
    raise SystemExit(main())
