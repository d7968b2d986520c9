"""Shared fixtures. Tests run offline; the embedded default is fetched once by `hf_attn.tooling.assets`."""

import hashlib
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_attn  # noqa: E402,F401  (registers the attention implementations)
from hf_attn.tooling import assets  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path():
    """Directory of the real SmolLM2-135M-Instruct checkpoint (fp32 safetensors)."""
    return assets.smollm2_dir()


@pytest.fixture(scope="session")
def persuasion_path():
    return assets.austen_file(assets.EVAL_NOVEL)


@pytest.fixture(scope="session")
def train_paths():
    return assets.train_text_files()


@pytest.fixture
def tmp_path(tmp_path):
    """pytest's `tmp_path`, deleted when the test ends: converted SmolLM2 checkpoints are ~0.5 GB each,
    and a run must not need more disk than its largest test."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tree_hashes(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file, "dir" for every directory (hidden ones included)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def exit_status(main, argv) -> int:
    """A command's exit status, whether `main(argv)` returns it or argparse raises SystemExit."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


# The tiny attention geometry the MLA and export tests share: E=48, Hq=6, Hkv=2, d=8 (4 RoPE pairs), 2 layers.
TINY_SHAPE = dict(
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
)


def saved_checkpoint(tmp_path_factory, name: str, model, tokenizer):
    """Generator for module-scoped fixtures: `model` and `tokenizer` saved in a fresh temporary directory,
    yielded, then deleted (tiny checkpoints, but many of them across the suite)."""
    import shutil

    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)
