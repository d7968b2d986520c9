"""Evaluation text: read through `datasets` (`load_corpus`), identified by name and sha256, tokenized once
(`tokenize`) into one continuous token stream, without special tokens, that the perplexity windows cut
anywhere."""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_attn.tooling import assets
from hf_attn.tooling.errors import one_line

SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Corpus:
    text: str
    name: str
    sha256: str  # of the UTF-8 encoded text

    @classmethod
    def from_text(cls, text: str, name: str) -> Corpus:
        if not text.strip():
            raise ValueError(f"The text of {name} is empty; give a file or dataset that contains text")
        return cls(text=text, name=name, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())


@contextlib.contextmanager
def _quiet_datasets():
    """No "Generating train split" bars for reading one local file (they would clutter one-line errors)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _read_file(path: Path) -> str:
    if not path.is_file():
        raise ValueError(f"Text file {path} does not exist (or is not a file); check the --text path")
    if path.stat().st_size == 0:
        raise ValueError(f"Text file {path} is empty; give a file that contains text")
    try:
        from datasets import load_dataset
    except ImportError:  # offline GPU machines may lack datasets (and pyarrow): the same text, read directly
        return path.read_text(encoding="utf-8")
    with _quiet_datasets():
        ds = load_dataset("text", data_files=str(path), sample_by="document", split="train")
    return "".join(ds["text"])  # one row: the whole document


def _read_dataset(name: str, config: str | None, split: str, text_column: str) -> str:
    from datasets import load_dataset

    try:
        ds = load_dataset(name, config, split=split)
    except Exception as err:  # hub / offline / missing split errors come in many types
        raise ValueError(
            f"Could not load dataset {name!r} (config {config!r}, split {split!r}): {one_line(err)}"
        ) from err
    if text_column not in ds.column_names:
        raise ValueError(f"Dataset {name!r} has no column {text_column!r}; its columns are {ds.column_names}")
    return SEPARATOR.join(ds[text_column])


def load_corpus(
    files: list[str | Path] | None = None,
    *,
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "test",
    text_column: str = "text",
) -> Corpus:
    """The text of `files`, each read whole and unchanged (`load_dataset("text", sample_by="document")`),
    joined with blank lines in the order given; or the rows of `text_column` of one `split` of `dataset` (a
    hub id, cached or online, e.g. `wikitext` / `wikitext-2-raw-v1`) joined with blank lines (the GPTQ /
    SparseGPT WikiText-2 convention); neither: the embedded *Persuasion*. ValueError if no text."""
    if files and dataset:
        raise ValueError("Give either text files or a dataset, not both")
    if dataset:
        text = _read_dataset(dataset, dataset_config, split, text_column)
        label = f"{dataset}" + (f"/{dataset_config}" if dataset_config else "") + f":{split}"
        return Corpus.from_text(text, label)
    paths = [Path(f) for f in files] if files else assets.eval_text_files()
    text = SEPARATOR.join(_read_file(p) for p in paths)
    return Corpus.from_text(text, "+".join(p.name for p in paths))


_TOKENIZED: dict[tuple[str, str], torch.Tensor] = {}  # (tokenizer sha256, text sha256) -> ids, this process
_TOKENIZED_MAX = 4


def tokenize(tokenizer, corpus_or_text: Corpus | str) -> torch.Tensor:
    """The whole text as one LongTensor (N,) of token ids, without special tokens (no BOS/EOS; SmolLM2's
    tokenizer adds none by default either).

    Remembered within the process for fast tokenizers (keyed by the sha256 of the tokenizer's serialization
    and of the text): the study evaluates and heals many checkpoints that share SmolLM2's tokenizer."""
    text = corpus_or_text.text if isinstance(corpus_or_text, Corpus) else corpus_or_text
    backend = getattr(tokenizer, "backend_tokenizer", None)
    key = None
    if backend is not None:
        sha = lambda s: hashlib.sha256(s.encode()).hexdigest()  # noqa: E731
        key = (sha(backend.to_str()), sha(text))
        if key in _TOKENIZED:
            return _TOKENIZED[key].clone()
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long)
    if key is not None:
        while len(_TOKENIZED) >= _TOKENIZED_MAX:
            _TOKENIZED.pop(next(iter(_TOKENIZED)))
        _TOKENIZED[key] = ids.clone()
    return ids
