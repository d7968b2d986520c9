"""Healing with LoRA (`--lora-rank R`, through peft): only low-rank adapters train, beside frozen float32
weights, so the optimizer state is that of the adapters; the output merges them into the weights and is a
plain checkpoint of the input's model type and layout (`merged`).

Adapted modules: `--lora-targets` names them by their last name component (`q_proj`, `o_proj`, ...), checked
against the checkpoint's weights before any work; the default is every linear projection of the attention
(`*.self_attn.<name>.weight`): `q_proj k_proj v_proj o_proj` for a GQA/MQA Llama, `q_proj kv_down_proj
k_up_proj k_rope_proj v_up_proj o_proj` for `llama_mla`. A projection without rows (a layer whose RoPE or
NoPE part is empty) gets no adapter. Adapters start as peft initialises them (A random from the run's seed,
B = 0, so the first forward is the input model's), scale alpha / R = 1.

Checkpoints of a LoRA run hold the adapters (peft's `adapter_model.safetensors` + `adapter_config.json`, with
the side files): `--resume` rebuilds the frozen model from the source and loads them, which continues the
same trajectory. FSDP is refused (its gathering of the output expects the plain model).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_attn.conversion.checkpoint.io import tensor_index
from hf_attn.conversion.training.recipe import ATTENTION_MARKER
from hf_attn.tooling.errors import UserError

ADAPTER_FILE = "adapter_model.safetensors"


def resolve_targets(source: Path, names: list[str] | None) -> tuple[str, ...]:
    """The leaf names of the modules to adapt, sorted: `names` (each may hold several, comma-separated), each
    of which must name a 2-D weight `*.<name>.weight` of `source`; None -> every attention projection."""
    index = tensor_index(source)
    matrices = [
        key[: -len(".weight")] for key in index if key.endswith(".weight") and len(index[key].shape) == 2
    ]
    leaves = {name.rsplit(".", 1)[-1] for name in matrices}
    attention = sorted({n.rsplit(".", 1)[-1] for n in matrices if ATTENTION_MARKER in f".{n}."})
    if names is None:
        if not attention:
            raise UserError(
                f"{source} has no *.self_attn.* projection for LoRA; name modules with --lora-targets"
            )
        return tuple(attention)
    wanted = sorted({part.strip() for name in names for part in name.split(",") if part.strip()})
    unknown = [name for name in wanted if name not in leaves]
    if unknown or not wanted:
        raise UserError(
            f"--lora-targets {' '.join(unknown) or '(empty)'}: no such linear module in {source} (attention "
            f"projections: {', '.join(attention) or 'none'})"
        )
    return tuple(wanted)


def wrap(net: torch.nn.Module, *, rank: int, targets: str, adapter_dir: Path | None = None):
    """`net` (float32, its weights frozen) with rank-`rank` adapters on the linear modules whose last name
    component is in `targets` (comma-separated); the adapters of a checkpoint `adapter_dir` loaded when
    resuming. Returns the peft model (the adapters are its only trainable parameters)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    leaves = set(targets.split(","))
    modules = [
        name
        for name, module in net.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in leaves and module.weight.numel()
    ]
    config = LoraConfig(
        r=rank, lora_alpha=rank, lora_dropout=0.0, bias="none", target_modules=modules, task_type="CAUSAL_LM"
    )
    model = get_peft_model(net, config)
    if adapter_dir is not None:
        result = set_peft_model_state_dict(model, load_file(adapter_dir / ADAPTER_FILE))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{adapter_dir / ADAPTER_FILE} does not hold this run's adapters (missing "
                f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})"
            )
    return model


def merged(model):
    """The plain model with every adapter merged into its weights (W + B A alpha / R); others as they are."""
    return model.merge_and_unload() if hasattr(model, "peft_config") else model
