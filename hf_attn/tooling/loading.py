"""Models for the offline tools: the ONE model resolver, dtype parsing, config / model / tokenizer loading
with clear errors, attention implementation names, checkpoint hashing and library versions.

Every function here raises `UserError` (one line, saying what would fix it) for a user mistake;
`hf_attn.tooling.cli.run_command` turns it into exit status 2. A model is loaded for a number only through
`load_causal_lm`, which refuses a checkpoint whose weights do not all load (`check_loaded`): a model with
missing, unexpected or misshapen weights would be partly random, and every score of it meaningless.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import struct
from pathlib import Path

import torch

import hf_attn  # noqa: F401  (registers the hf-attn attention implementations and model types)
from hf_attn.tooling import assets
from hf_attn.tooling.errors import UserError, one_line
from hf_attn.tooling.files import WEIGHT_SUFFIXES, checkpoint_hash

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}
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
    """UserError listing the available names for an unknown one (None = transformers' default; a hub kernel
    id containing '/' is passed on to transformers unchecked)."""
    if name is None or "/" in name:
        return
    available = attention_implementations()
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


def check_config_file(model: str | Path) -> None:
    """UserError naming config.json of a local checkpoint when it is missing or not a JSON object."""
    path = Path(model) / "config.json"
    if not Path(model).is_dir():
        return  # a hub id: transformers reads it from the cache
    if not path.is_file():
        raise UserError(f"{model} has no config.json; it is not a Hugging Face checkpoint directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{path} is not valid JSON ({one_line(err)}); repair or replace it") from err
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"{path} has no model_type; it is not a transformers config")


def load_config(model: str | Path, *, trust_remote_code: bool = False):
    """AutoConfig of a causal LM, or UserError if the path/id is not one."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    check_config_file(model)
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
    return config


def check_weight_files(model: str | Path) -> None:
    """UserError naming the file when a local checkpoint's safetensors are unreadable before any loading:
    a header that does not parse, tensor data past the end of the file (a truncated copy), a shard the
    index lists but the directory lacks, or no weight file at all."""
    directory = Path(model)
    if not directory.is_dir():
        return
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(
                f"{index} is not a safetensors index ({one_line(err)}); repair or replace it"
            ) from err
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise UserError(f"{index} lists missing shards: {', '.join(missing[:3])}; copy them in")
        files = [directory / n for n in names]
    else:
        files = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors")
    if not files and not any(p.suffix in WEIGHT_SUFFIXES for p in directory.iterdir()):
        raise UserError(f"{directory} has no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    for path in files:
        check_safetensors_file(path)


def check_safetensors_file(path: Path) -> None:
    """UserError naming `path` unless its safetensors header parses and its tensors lie within the file."""
    size = path.stat().st_size
    fix = "the file is damaged or truncated; copy it again"
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        ends = [int(h["data_offsets"][1]) for k, h in header.items() if k != "__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as err:
        raise UserError(f"{path} is not a readable safetensors file ({one_line(err)}); {fix}") from err
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise UserError(f"{path} holds {size} bytes but its tensors need {need}; {fix}")


def check_loaded(model: str | Path, info: dict) -> None:
    """UserError unless every weight of the model came from the checkpoint: `info` is from_pretrained's
    `output_loading_info` (missing, unexpected and mismatched keys). Names the first offending tensors."""
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
            f"{model}: the weights do not match config.json: {'; '.join(problems)}; a model that does not "
            "load completely would be partly random: repair the checkpoint or its config.json"
        )


def _safetensors_shapes(model: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a local checkpoint's safetensors, from the headers alone."""
    directory = Path(model)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = [directory / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    shapes = {}
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def check_checkpoint_complete(model: str | Path):
    """UserError unless a local safetensors checkpoint holds exactly the weights its config describes (names
    and shapes, tied copies excepted), checked from the headers against the model built on the meta device
    (nothing is loaded): for readers that take weights layer by layer instead of `load_causal_lm`, and
    before slow work that ends in `load_causal_lm`. Returns the config."""
    import re

    from transformers import AutoModelForCausalLM

    config = load_config(model)
    check_weight_files(model)
    present = _safetensors_shapes(model) if Path(model).is_dir() else {}
    if not present:  # a hub id or .bin weights: `load_causal_lm` checks them as it loads
        return config
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    expected, seen = {}, set()
    for name, tensor in lm.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # a tied weight is stored once
            expected[name] = tuple(tensor.shape)
        seen.add(id(tensor))
    ignored = [re.compile(p) for p in getattr(lm, "_keys_to_ignore_on_load_unexpected", None) or ()]
    stored_once = {n for n in lm.state_dict() if n not in expected}
    check_loaded(
        model,
        {
            "missing_keys": [n for n in expected if n not in present],
            "unexpected_keys": [
                n
                for n in present
                if n not in expected and n not in stored_once and not any(p.search(n) for p in ignored)
            ],
            "mismatched_keys": [n for n in expected if n in present and present[n] != expected[n]],
        },
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
    """`AutoModelForCausalLM.from_pretrained` in eval mode, every weight loaded (`check_loaded`), with
    one-line UserErrors for user mistakes."""
    from transformers import AutoModelForCausalLM

    check_attn_implementation(attn_implementation)
    dtype = parse_dtype(dtype)
    load_config(model, trust_remote_code=trust_remote_code)
    check_weight_files(model)
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code, "output_loading_info": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        lm, info = AutoModelForCausalLM.from_pretrained(str(model), **kwargs)
    except (OSError, ValueError) as err:
        raise UserError(f"Could not load {model} as a causal LM: {one_line(err)}") from err
    check_loaded(model, info)
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
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    out["torch_threads"] = str(torch.get_num_threads())
    return out


def model_device(model) -> torch.device:
    """Device of the input embeddings (where input ids must go, also under device_map="auto")."""
    return model.get_input_embeddings().weight.device
