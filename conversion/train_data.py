"""Training data for healing: text -> one token stream -> fixed-length chunks -> a seeded, resumable order.

- `load_train_corpus`: text files, a dataset split, or (neither) the embedded healing text: the five Austen
  novels other than *Persuasion* (`hf_attn.tooling.assets.train_text_files()`), read through
  `hf_attn.tooling.corpus`.
- `check_disjoint`: training and evaluation text must never overlap: not the same file, not the same content
  (sha256 of every file and of the joined corpora), and no shared paragraph of 200+ characters.
  `check_not_embedded_eval` applies it to every embedded evaluation text (*Persuasion*, the Python FAQ).
- `chunk_tokens`: the token stream cut into `(N, seq_len)` chunks; the ragged tail is dropped.
- `ChunkOrder`: an endless sampler over chunk indices, epoch e being a permutation seeded by (seed, e). It
  starts at any global position, so a resumed run sees exactly the chunks an uninterrupted one would.
- `make_loader`: a plain `DataLoader` over the chunks in that order; `Accelerator.prepare` shards it across
  processes (process p of P takes every P-th batch), so the global batch of a step is the same chunks
  whatever the number of processes, as long as batch_size x processes is the same.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Sampler

from hf_attn.tooling import assets
from hf_attn.tooling.corpus import Corpus, load_corpus
from hf_attn.tooling.files import sha256_file

MIN_PARAGRAPH_CHARS = 200  # shorter shared passages (chapter titles, "by Jane Austen") are not overlap


# --------------------------------------------------------------------------------------------- text


def load_train_corpus(
    files: Sequence[str | os.PathLike] | None = None,
    *,
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    text_column: str = "text",
) -> tuple[Corpus, list[Path]]:
    """(corpus, its files) for healing: the given files, a dataset split, or the embedded healing novels."""
    if files and dataset:
        raise ValueError("Give either --train-text files or --dataset, not both")
    if dataset:
        corpus = load_corpus(
            dataset=dataset, dataset_config=dataset_config, split=split, text_column=text_column
        )
        return corpus, []
    paths = [Path(f) for f in files] if files else assets.train_text_files()
    return load_corpus(paths), paths


def load_eval_corpus(files: Sequence[str | os.PathLike] | None = None) -> tuple[Corpus, list[Path]]:
    """(corpus, its files) for held-out evaluation: the given files or the embedded *Persuasion*."""
    paths = [Path(f) for f in files] if files else assets.eval_text_files()
    return load_corpus(paths), paths


def _paragraph_hashes(text: str) -> dict[str, str]:
    """sha256 of each whitespace-normalised paragraph of at least MIN_PARAGRAPH_CHARS -> its first words."""
    out = {}
    for block in re.split(r"\n\s*\n", text):
        norm = " ".join(block.split())
        if len(norm) >= MIN_PARAGRAPH_CHARS:
            out[hashlib.sha256(norm.encode("utf-8")).hexdigest()] = norm[:60]
    return out


def check_disjoint(
    train: Corpus, train_files: Sequence[Path], held_out: Corpus, eval_files: Sequence[Path]
) -> None:
    """ValueError if training and evaluation text share a file, a file's content or a paragraph."""
    for t in train_files:
        for e in eval_files:
            if Path(t).resolve() == Path(e).resolve() or (
                Path(t).exists() and Path(e).exists() and os.path.samefile(t, e)
            ):
                raise ValueError(
                    f"Training text {t} is also the evaluation text; train and evaluate on different text"
                )
    eval_hashes = {sha256_file(e): e for e in eval_files}
    for t in train_files:
        digest = sha256_file(t)
        if digest in eval_hashes:
            raise ValueError(
                f"Training text {t} has the same content (sha256 {digest[:12]}) as the evaluation text "
                f"{eval_hashes[digest]}; train and evaluate on different text"
            )
    if train.sha256 == held_out.sha256:
        raise ValueError(
            f"Training text {train.name} and evaluation text {held_out.name} are identical "
            f"(sha256 {train.sha256[:12]}); train and evaluate on different text"
        )
    shared = (
        _paragraph_hashes(train.text).keys() & (eval_paragraphs := _paragraph_hashes(held_out.text)).keys()
    )
    if shared:
        example = eval_paragraphs[next(iter(sorted(shared)))]
        raise ValueError(
            f"Training text {train.name} and evaluation text {held_out.name} share {len(shared)} "
            f"paragraph(s) (e.g. {example!r}...); remove the evaluation text from the training text"
        )


def check_not_embedded_eval(train: Corpus, train_files: Sequence[Path]) -> None:
    """ValueError if the training text overlaps any embedded evaluation text (`check_disjoint`): *Persuasion*
    and, once fetched, the Python FAQ, whatever `--eval-text` the run measures with."""
    for path in assets.embedded_eval_files(fetch=False):
        held_out = Corpus.from_text(path.read_text(encoding="utf-8"), name=str(path))
        check_disjoint(train, train_files, held_out, [path])


# --------------------------------------------------------------------------------------------- chunks


def chunk_tokens(
    ids: torch.Tensor, seq_len: int, *, min_chunks: int = 1, name: str = "training text"
) -> torch.Tensor:
    """(N,) token ids -> (N // seq_len, seq_len) chunks; ValueError if fewer than `min_chunks` fit."""
    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 (got {seq_len})")
    n = ids.numel() // seq_len
    if n < min_chunks:
        raise ValueError(
            f"The {name} is too short: {ids.numel()} tokens make {n} chunk(s) of --seq-len {seq_len}, but "
            f"one optimizer step needs {min_chunks}; give more text or lower --seq-len / --batch-size / "
            "--grad-accum"
        )
    return ids[: n * seq_len].view(n, seq_len)  # (N, L)


class ChunkOrder(Sampler[int]):
    """Endless order over `num_chunks` chunk indices, starting at global position `start`.

    Position p lies in epoch p // num_chunks at offset p % num_chunks; epoch e is `randperm(num_chunks)`
    drawn from a generator seeded with `seed + e` (its own generator: the global RNG is never touched).
    """

    def __init__(self, num_chunks: int, *, seed: int, start: int = 0):
        assert num_chunks > 0 and start >= 0, (num_chunks, start)
        self.num_chunks, self.seed, self.start = num_chunks, seed, start

    def permutation(self, epoch: int) -> torch.Tensor:
        rng = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_chunks, generator=rng)

    def __iter__(self) -> Iterator[int]:
        epoch, offset = divmod(self.start, self.num_chunks)
        while True:
            yield from self.permutation(epoch)[offset:].tolist()
            epoch, offset = epoch + 1, 0

    def __len__(self) -> int:  # endless; DataLoader only asks when someone calls len() on it
        return 2**62


def make_loader(chunks: torch.Tensor, *, batch_size: int, seed: int, start: int = 0) -> DataLoader:
    """Batches of `batch_size` chunks (B, L) in `ChunkOrder`, from global chunk position `start`."""
    return DataLoader(chunks, batch_size=batch_size, sampler=ChunkOrder(len(chunks), seed=seed, start=start))
