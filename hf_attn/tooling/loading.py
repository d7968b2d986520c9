"""Models for the offline tools: the ONE model resolver, dtype parsing, config / model / tokenizer loading
with clear errors, attention implementation names, checkpoint hashing and library versions.

Every function here raises `UserError` (one line, saying what would fix it) for a user mistake. A model is
loaded for a number only through `load_causal_lm`, which refuses weights that do not all load or are not
finite (every score of a partly random model is meaningless); `checkpoint_weights` makes the same checks from
the files before any work.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import torch

import hf_attn  # noqa: F401  (registers the hf-attn attention implementations and model types)
from hf_attn.tooling import assets
from hf_attn.tooling.errors import UserError, one_line
from hf_attn.tooling.files import checkpoint_hash
from hf_attn.tooling.weights import (
    check_finite,
    check_finite_weights,
    safetensors_header,
    tensor_index,
    weight_files,
)

CONFIG_NAME = "config.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}
_UNTIED_HINT = (  # a checkpoint without its output layer whose config says it has one
    " (config.json sets tie_word_embeddings false, yet no lm_head.weight is stored: set it true if the "
    "output layer is the input embedding)"
)
_VERSIONED = ("torch", "transformers", "accelerate", "datasets", "tokenizers", "safetensors", "hf-attn")


def parse_dtype(name: str | torch.dtype, flag: str = "dtype") -> torch.dtype:
    """`--dtype` value ("float32", "bf16", ...) or a torch.dtype -> one of the supported torch dtypes."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise UserError(f"Unsupported dtype {name}; choose one of {', '.join(DTYPES)}")
        return name
    if DTYPE_ALIASES.get(name, name) not in DTYPES:
        raise UserError(f"Unknown {flag} {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[DTYPE_ALIASES.get(name, name)]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the spelling config.json uses)."""
    return str(dtype).removeprefix("torch.")


def check_attn_implementation(name: str | None) -> None:
    """UserError listing the available names for an unknown one (None = transformers' default; a hub kernel
    id containing '/' is passed on to transformers unchecked). Available: eager, sdpa, flex_attention, every
    registered `hf_attn_*` one, and the flash-attention ones whose package is installed."""
    if name is None or "/" in name:
        return
    from transformers import AttentionInterface
    from transformers.utils import import_utils

    available = ["eager", "sdpa", "flex_attention"]
    available += sorted(k for k in AttentionInterface._global_mapping if k.startswith("hf_attn_"))
    for version in (2, 3, 4):
        check = getattr(import_utils, f"is_flash_attn_{version}_available", None)
        if check is not None and check():
            available.append(f"flash_attention_{version}")
    if name not in available:
        raise UserError(f"Unknown attention implementation {name!r}; registered: {', '.join(available)}")


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
        raise UserError(f"Model {text!r} is not a checkpoint directory (expected config.json + weights)")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.py"]
    try:
        return Path(snapshot_download(text, allow_patterns=patterns))
    except Exception as err:  # network, auth, offline without a cached copy
        offline = " (offline: HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise UserError(
            f"Could not fetch {text!r} from the Hugging Face hub{offline} ({type(err).__name__}); pass a "
            "local checkpoint directory, or check the id and the network"
        ) from err


def read_config(model_dir: str | os.PathLike) -> dict:
    """The config.json of the checkpoint directory `model_dir`, as read; UserError naming the file when it
    is missing, not valid JSON or not a JSON object."""
    path = Path(model_dir) / CONFIG_NAME
    if not path.is_file():
        raise UserError(f"{path} not found: {model_dir} is not a Hugging Face checkpoint directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{path} is not valid JSON ({one_line(err)}); repair or replace it") from err
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object; it is not a transformers config")
    return config


def load_config(model: str | Path, *, trust_remote_code: bool = False):
    """AutoConfig of a causal LM, or UserError if the path/id is not one (for a local checkpoint, naming
    config.json when it is missing, not a JSON object or has no model_type)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if Path(model).is_dir():  # (a hub id: transformers reads it from the cache)
        if not (Path(model) / CONFIG_NAME).is_file():
            raise UserError(f"{model} has no config.json; it is not a Hugging Face checkpoint directory")
        if "model_type" not in read_config(model):
            raise UserError(f"{Path(model) / CONFIG_NAME} has no model_type; it is not a transformers config")
    try:
        config = AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(
            f"{model} is not a causal LM checkpoint (no usable config.json: {one_line(err)})"
        ) from err
    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if not remote and type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(
            f"{model} is not a causal LM: model type {config.model_type!r} has no AutoModelForCausalLM class"
        )
    text = config.get_text_config()
    check_head_counts(getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None))
    return config


def check_head_counts(num_heads, num_kv_heads) -> None:
    """UserError unless every KV head serves the same number of query heads (the attention of every model
    class here divides them); counts that are not positive integers are left to the model's own checks."""
    valid = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (num_heads, num_kv_heads))
    if valid and num_heads % num_kv_heads:
        raise UserError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}: each "
            "KV head must serve the same number of query heads; repair config.json (and the weights)"
        )


def vocab_size(config) -> int | None:
    """Rows of the model's input embedding as its config builds it (`vocab_size`)."""
    size = getattr(config.get_text_config(), "vocab_size", None)
    return size if isinstance(size, int) else None


def check_token_ids(input_ids: torch.Tensor, rows: int | None, *, tokenizer=None) -> None:
    """UserError unless every token id of a text indexes one of the embedding's `rows` (None: unknown, not
    checked): a tokenizer larger than the model's vocabulary gives ids the embedding cannot hold."""
    if rows is None or not input_ids.numel() or int(input_ids.max()) < rows:
        return
    size = f", its tokenizer {len(tokenizer)}" if tokenizer is not None else ""
    raise UserError(
        f"the text holds token id {int(input_ids.max())}, but the model's embedding holds {rows} tokens "
        f"(vocab_size in config.json{size}): the tokenizer is not this model's; use the model's own "
        "tokenizer or a config whose vocab_size covers it"
    )


def check_tokenizer_fits(tokenizer, rows: int | None) -> None:
    """UserError when the tokenizer has more tokens than the embedding has `rows`, for texts not known in
    advance (task items, padding): `check_token_ids`' rule before the text is seen."""
    if rows is None or len(tokenizer) <= rows:
        return
    raise UserError(
        f"the tokenizer has {len(tokenizer)} tokens, but the model's embedding holds {rows} tokens "
        "(vocab_size in config.json): a text can give ids the embedding cannot hold; use the model's own "
        "tokenizer or a config whose vocab_size covers it"
    )


def check_weight_files(model: str | Path) -> list[Path]:
    """The weight files transformers reads from a local checkpoint (`weights.weight_files`: its files, its
    precedence), UserError naming the file when one is unreadable before any loading: a header that does
    not parse, tensor data past the end of the file (a truncated copy), a shard the index lists but the
    directory lacks, or no weight file at all. [] for a hub id."""
    directory = Path(model)
    if not directory.is_dir():
        return []
    files = weight_files(directory)
    for path in files:
        if path.suffix == ".safetensors":
            safetensors_header(path)
    return files


def check_loaded(model: str | Path, info: dict, *, hint: str = "") -> None:
    """UserError unless every weight of the model came from the checkpoint: `info` is from_pretrained's
    `output_loading_info` (missing, unexpected and mismatched keys). Names the first offending tensors
    (and `hint`, a likely cause)."""
    problems = []
    for key, what in (
        ("missing_keys", "missing from the checkpoint"),
        ("mismatched_keys", "of another shape than the config implies"),
        ("unexpected_keys", "in the checkpoint but not in the model its config describes"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            problems.append(f"{len(names)} weights {what} ({', '.join(names[:3])}{more})")
    if problems:
        raise UserError(
            f"{model}: the weights do not match config.json: {'; '.join(problems)}{hint}; a model that does "
            "not load completely would be partly random: repair the checkpoint or its config.json"
        )


def _dropped_on_load(lm) -> re.Pattern | None:
    """What `from_pretrained` drops from a checkpoint of `lm`'s class without a word (transformers'
    `_adjust_missing_and_unexpected_keys`): the class's `_keys_to_ignore_on_load_unexpected`, and the
    buffers older versions stored (`rotary_emb.inv_freq` of every layer, `position_ids`) where the model
    now computes them itself."""
    buffers = [name for name, _ in lm.named_buffers()]
    patterns = set(getattr(lm, "_keys_to_ignore_on_load_unexpected", None) or ())
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None


@dataclass(frozen=True)
class CheckedWeights:
    """What `checkpoint_weights` found: the config, and the stored names transformers drops on load."""

    config: object  # the AutoConfig
    dropped: frozenset[str]


def checkpoint_weights(model: str | Path) -> CheckedWeights:
    """UserError unless a local safetensors checkpoint holds exactly the weights its config describes (names
    and shapes, tied copies and what transformers drops on load excepted), checked from the headers of the
    files transformers reads (`weights.weight_files`) against the model built on the meta device, and
    every floating weight is finite (`weights.check_finite_weights`: each tensor read once, one at a time).
    For readers that take weights tensor by tensor instead of `load_causal_lm`, and before slow work that
    ends in `load_causal_lm`. A hub id or `.bin` weights: `load_causal_lm` checks them as it loads."""
    from transformers import AutoModelForCausalLM

    config = load_config(model)
    files = check_weight_files(model)
    if not files or any(f.suffix != ".safetensors" for f in files):
        return CheckedWeights(config, frozenset())
    index = tensor_index(model)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    state, expected, seen = lm.state_dict(keep_vars=True), {}, set()
    for name, tensor in state.items():
        if id(tensor) not in seen:  # a tied weight is stored once
            expected[name] = tuple(tensor.shape)
        seen.add(id(tensor))
    drop = _dropped_on_load(lm)
    unexpected = [n for n in index if n not in state]
    dropped = frozenset(n for n in unexpected if drop is not None and drop.search(n))
    missing = [n for n in expected if n not in index]
    tied = getattr(config.get_text_config(), "tie_word_embeddings", True)
    hint = _UNTIED_HINT if "lm_head.weight" in missing and not tied else ""
    info = {
        "missing_keys": missing,
        "unexpected_keys": [n for n in unexpected if n not in dropped],
        "mismatched_keys": [n for n in expected if n in index and index[n].shape != expected[n]],
    }
    check_loaded(model, info, hint=hint)
    check_finite_weights(model, {n: i for n, i in index.items() if n not in dropped})
    return CheckedWeights(config, dropped)


def check_checkpoint_complete(model: str | Path):
    """`checkpoint_weights`' checks (complete, matching the config, finite); returns the config."""
    return checkpoint_weights(model).config


def load_causal_lm(
    model: str | Path,
    *,
    attn_implementation: str | None = None,
    dtype: str | torch.dtype = torch.float32,
    device_map: str | dict | None = None,
    trust_remote_code: bool = False,
):
    """`AutoModelForCausalLM.from_pretrained` in eval mode, every weight loaded (`check_loaded`), with
    one-line UserErrors for user mistakes."""
    from transformers import AutoModelForCausalLM

    check_attn_implementation(attn_implementation)
    dtype = parse_dtype(dtype)
    load_config(model, trust_remote_code=trust_remote_code)
    check_weight_files(model)
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code, "output_loading_info": True}
    given = {"attn_implementation": attn_implementation, "device_map": device_map}
    kwargs.update({key: value for key, value in given.items() if value is not None})
    try:
        lm, info = AutoModelForCausalLM.from_pretrained(str(model), **kwargs)
    except (OSError, ValueError) as err:
        raise UserError(f"Could not load {model} as a causal LM: {one_line(err)}") from err
    check_loaded(model, info)
    check_finite(((n, p) for n, p in lm.named_parameters() if not p.is_meta), where=model)
    return lm.eval()


def load_tokenizer(model: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"No usable tokenizer in {model}: {one_line(err)}") from err


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
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    out["torch_threads"] = str(torch.get_num_threads())
    return out


def model_device(model) -> torch.device:
    """Device of the input embeddings (where input ids must go, also under device_map="auto")."""
    return model.get_input_embeddings().weight.device
