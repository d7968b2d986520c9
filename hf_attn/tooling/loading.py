"""Models for the offline tools: the ONE model resolver, dtype parsing, config / model / tokenizer loading
with clear errors, attention implementation names, checkpoint hashing and library versions.

Every function here raises `ValueError` / `FileNotFoundError` (one line, saying what would fix it) for a user
mistake; `hf_attn.tooling.cli` turns those into exit status 2.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

import torch

import hf_attn  # noqa: F401  (registers the hf-attn attention implementations and model types)
from hf_attn.tooling import assets
from hf_attn.tooling.cli import one_line
from hf_attn.tooling.files import checkpoint_hash

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}
_VERSIONED = ("torch", "transformers", "accelerate", "datasets", "tokenizers", "safetensors", "hf-attn")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """`--dtype` value ("float32", "bf16", ...) or a torch.dtype -> one of the supported torch dtypes."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"Unsupported dtype {name}; choose one of {list(DTYPES)}")
        return name
    if DTYPE_ALIASES.get(name, name) not in DTYPES:
        raise ValueError(f"Unknown dtype {name!r}; choose one of {list(DTYPES)}")
    return DTYPES[DTYPE_ALIASES.get(name, name)]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the spelling config.json uses)."""
    return str(dtype).removeprefix("torch.")


def attention_implementations() -> list[str]:
    """Attention implementation names usable here: eager, sdpa, flex_attention, every registered `hf_attn_*`
    one, and the flash-attention ones whose package is installed."""
    from transformers import AttentionInterface
    from transformers.utils import import_utils

    names = ["eager", "sdpa", "flex_attention"]
    names += sorted(k for k in AttentionInterface._global_mapping if k.startswith("hf_attn_"))
    for version in (2, 3, 4):
        check = getattr(import_utils, f"is_flash_attn_{version}_available", None)
        if check is not None and check():
            names.append(f"flash_attention_{version}")
    return names


def check_attn_implementation(name: str | None) -> None:
    """ValueError listing the available names for an unknown one (None = transformers' default; a hub kernel
    id containing '/' is passed on to transformers unchecked)."""
    if name is None or "/" in name:
        return
    available = attention_implementations()
    if name not in available:
        raise ValueError(f"Unknown attention implementation {name!r}; registered: {', '.join(available)}")


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The one model resolver: None -> the embedded SmolLM2; an existing local directory as is; anything
    else a hub id, fetched (or read offline from the HF cache) with `huggingface_hub.snapshot_download`."""
    if model is None:
        return assets.smollm2_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    text = str(model)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise FileNotFoundError(
            f"Model {text!r} is not a checkpoint directory (expected config.json + weights)."
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.py"]
    try:
        return Path(snapshot_download(text, allow_patterns=patterns))
    except Exception as err:  # network, auth, offline without a cached copy
        offline = " (offline: HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise FileNotFoundError(
            f"Could not fetch {text!r} from the Hugging Face hub{offline} ({type(err).__name__}); pass a "
            "local "
            "checkpoint directory, or check the id and the network."
        ) from err


def load_config(model: str | Path, *, trust_remote_code: bool = False):
    """AutoConfig of a causal LM, or ValueError if the path/id is not one."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(
            f"{model} is not a causal LM checkpoint (no usable config.json: {one_line(err)})"
        ) from err
    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if not remote and type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"{model} is not a causal LM: model type {config.model_type!r} has no AutoModelForCausalLM class"
        )
    return config


def load_causal_lm(
    model: str | Path,
    *,
    attn_implementation: str | None = None,
    dtype: str | torch.dtype = torch.float32,
    device_map: str | dict | None = None,
    trust_remote_code: bool = False,
):
    """`AutoModelForCausalLM.from_pretrained` in eval mode, with one-line ValueErrors for user mistakes."""
    from transformers import AutoModelForCausalLM

    check_attn_implementation(attn_implementation)
    dtype = parse_dtype(dtype)
    load_config(model, trust_remote_code=trust_remote_code)
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        lm = AutoModelForCausalLM.from_pretrained(str(model), **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"Could not load {model} as a causal LM: {one_line(err)}") from err
    return lm.eval()


def load_tokenizer(model: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"No usable tokenizer in {model}: {one_line(err)}") from err


def max_positions(config) -> int | None:
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def model_hash(model: str | Path) -> str | None:
    """sha256 of the weight files (`hf_attn.files.checkpoint_hash`) of a local directory, or of the cached
    snapshot of a hub id; None if neither can be found."""
    path = Path(model)
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(str(model), local_files_only=True))
        except Exception:  # not a hub id, or not cached: nothing to hash
            return None
    try:
        return checkpoint_hash(path)
    except FileNotFoundError:
        return None


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    out["torch_threads"] = str(torch.get_num_threads())
    return out


def model_device(model) -> torch.device:
    """Device of the input embeddings (where input ids must go, also under device_map="auto")."""
    return model.get_input_embeddings().weight.device
