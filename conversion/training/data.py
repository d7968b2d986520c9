"""Healing's data and settings: `HealSettings` (every option; the command line is built from it), the
tokenized training chunks and held-out evaluation text (`load_data`; the two never overlap: `check_disjoint`)
and the recipe they give (`make_recipe`).

The order of the chunks: `ChunkOrder` starts at any global position, so a resumed run sees exactly the chunks
an uninterrupted one would. The loader (in `state`) is a plain `DataLoader` over the chunks in that order;
`Accelerator.prepare` shards it across processes (process p of P takes every P-th batch), so the global batch
of a step is the same chunks whatever the number of processes, as long as batch_size x processes is the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch.utils.data import Sampler

from hf_attn.conversion.training.recipe import (
    CLOCKS,
    DEFAULT_DISTILL_TEMPERATURE,
    DEFAULT_DISTILL_WEIGHT,
    DEFAULT_MAX_STEPS,
    DEFAULT_TEACHER,
    DEFAULT_TRAIN_CORPUS,
    PRECISIONS,
    SCHEDULES,
    STEP_DEFAULTS,
    TRAINABLE,
    HealRecipe,
    check_positive,
    checkpoint_kind,
    default_state_dir,
    plan_budget,
    resolve_schedule,
)
from hf_attn.tooling import assets, loading
from hf_attn.tooling.cli import check_choices, setting
from hf_attn.tooling.corpus import SEPARATOR, Corpus, load_corpus, tokenize
from hf_attn.tooling.devices import DEFAULT_DEVICE, DEVICE_HELP, DEVICES, resolve_device
from hf_attn.tooling.errors import check_seed
from hf_attn.tooling.files import sha256_file
from hf_attn.tooling.perplexity import check_window

BY_CHECKPOINT = "docs/healing.md: Defaults by checkpoint"  # --trainable, --seq-len and --lr when left out
MIN_PARAGRAPH_CHARS = 200  # shorter shared passages (chapter titles, "by Jane Austen") are not overlap


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
        return load_corpus(
            dataset=dataset, dataset_config=dataset_config, split=split, text_column=text_column
        ), []
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
    eval_paragraphs = _paragraph_hashes(held_out.text)
    shared = _paragraph_hashes(train.text).keys() & eval_paragraphs.keys()
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


def chunk_tokens(ids: torch.Tensor, seq_len: int, *, min_chunks: int = 1) -> torch.Tensor:
    """(N,) token ids -> (N // seq_len, seq_len) chunks; ValueError if fewer than `min_chunks` fit."""
    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 (got {seq_len})")
    n = ids.numel() // seq_len
    if n < min_chunks:
        raise ValueError(
            f"The training text is too short: {ids.numel()} tokens make {n} chunk(s) of --seq-len {seq_len}, "
            f"but one optimizer step needs {min_chunks}; give more text or lower --seq-len / --batch-size / "
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


@dataclass(frozen=True)
class HealSettings:
    """Every option of a healing run; `hf-attn heal`'s flags are built from these fields (`--field-name`)."""

    output: str = setting(help="directory of the healed checkpoint", required=True)
    model: str | None = setting(None, "checkpoint directory or hub id (default: the embedded SmolLM2)")
    train_text: list[str] | None = setting(
        None,
        f"training text files (default: --train-corpus {DEFAULT_TRAIN_CORPUS})",
        metavar="FILE",
        exclusive="train source",
    )
    train_corpus: str | None = setting(
        None,
        "an embedded training corpus: austen (the five non-eval novels), python-docs (five sections, not the "
        "FAQ) or mix (both, equal token shares: the documentation's chunks repeat to match the novels'; the "
        f"default without --train-text or --dataset: {DEFAULT_TRAIN_CORPUS})",
        choices=assets.CORPORA,
        exclusive="train source",
    )
    dataset: str | None = setting(
        None, "datasets id of the training text, e.g. wikitext", exclusive="train source"
    )
    dataset_config: str | None = setting(None)
    dataset_split: str = setting("train")
    text_column: str = setting("text")
    eval_text: list[str] | None = setting(None, "default: Persuasion", metavar="FILE")
    max_steps: int | None = setting(None, f"default {DEFAULT_MAX_STEPS} if no budget is given")
    max_tokens: int | None = setting(None, "training tokens (rounded up to whole steps)")
    max_minutes: float | None = setting(None, "training time, evaluation excluded")
    budget_clock: str = setting(
        "wall",
        "what --max-minutes counts: wall (default) or cpu (process CPU time: fair on a shared machine)",
        choices=CLOCKS,
    )
    seq_len: int | None = setting(None, f"tokens per chunk (default: by the checkpoint, {BY_CHECKPOINT})")
    batch_size: int = setting(1, "chunks per process per micro-step")
    grad_accum: int = setting(1)
    lr: float | None = setting(
        None,
        f"peak learning rate of every tensor (default: by the checkpoint, {BY_CHECKPOINT})",
        exclusive="learning rate",
    )
    relative_lr: float | None = setting(
        None,
        "each tensor's peak lr as this fraction of its RMS at the start, instead of one --lr (as hf-attn "
        "refine: a converted model's latent factors differ a hundredfold in scale)",
        exclusive="learning rate",
    )
    warmup_steps: int = setting(0)
    schedule: str | None = setting(
        None, "default: cosine with a step budget, else constant", choices=SCHEDULES
    )
    weight_decay: float = setting(0.0)
    max_grad_norm: float | None = setting(1.0, "0 disables clipping")
    trainable: str | None = setting(
        None,
        f"all, or attention: only *.self_attn.* parameters (default: by the checkpoint, {BY_CHECKPOINT})",
        choices=TRAINABLE,
    )
    teacher: str = setting(
        DEFAULT_TEACHER,
        "distil from a teacher: auto (the source the conversion record names, when it is on this machine; "
        "else next-token labels only, said in one line), a checkpoint DIR, or none (next-token labels only)",
        metavar="auto|DIR|none",
    )
    distill_temperature: float | None = setting(
        None,
        f"with a teacher: the softmax temperature (KL x T^2; default {DEFAULT_DISTILL_TEMPERATURE})",
        metavar="T",
    )
    distill_weight: float | None = setting(
        None,
        "with a teacher: w in w x KL + (1 - w) x next-token cross-entropy, 0..1 "
        f"(default {DEFAULT_DISTILL_WEIGHT})",
        metavar="W",
    )
    lora_rank: int | None = setting(
        None,
        "train rank-R LoRA adapters (peft) instead of the weights; merged into the weights on save",
        metavar="R",
    )
    lora_targets: list[str] | None = setting(
        None,
        "with --lora-rank: the adapted modules' names (e.g. q_proj o_proj; default: every linear projection "
        "of the attention)",
        metavar="NAME",
    )
    autocast_dtype: str = setting(
        "float32",
        "training compute precision (autocast; master weights stay float32, the output keeps the input's "
        "dtype)",
        choices=tuple(PRECISIONS),
        deprecated_flags=("--dtype",),
    )
    attn_implementation: str | None = setting(None)
    trust_remote_code: bool = setting(False)
    device: str = setting(
        DEFAULT_DEVICE, f"{DEVICE_HELP}; under accelerate launch: accelerate's device", choices=DEVICES
    )
    eval_every: int = setting(0, "held-out perplexity every S steps (0: off)")
    eval_tokens: int = setting(8192, "first N tokens of the eval text (0: no eval)")
    eval_context: int = setting(1024, "window length (disjoint windows)")
    checkpoint_every: int = setting(0, "atomic resumable checkpoint every N steps")
    state_dir: str | None = setting(None, "checkpoints + log.jsonl (default: OUTPUT.heal)")
    keep_checkpoints: bool = setting(False, "end with a checkpoint (resume later with a larger budget)")
    resume: bool = setting(False, "continue from the newest checkpoint in the state dir")
    seed: int = setting(0)
    gradient_checkpointing: bool = setting(False)
    overwrite: bool = setting(False)

    def validate(self) -> None:
        """ValueError for a bad value (cheap: before any loading)."""
        check_choices(self)
        resolve_device(self.device)  # --device cuda without CUDA: refused here, before any loading
        for name in ("batch_size", "grad_accum"):
            check_positive(name, getattr(self, name))
        for name in ("seq_len", "lr", "max_steps", "max_tokens", "max_minutes", "relative_lr"):
            check_positive(name, getattr(self, name), allow_none=True)
        for name in ("warmup_steps", "eval_every", "eval_tokens", "checkpoint_every", "weight_decay"):
            check_positive(name, getattr(self, name), allow_zero=True)
        if self.eval_tokens:
            check_window(self.eval_context, None)
        check_seed(self.seed)
        # distillation and LoRA options out of range, or that nothing would use
        if not isinstance(self.teacher, str) or not self.teacher.strip():
            raise ValueError("--teacher needs auto, none or a checkpoint directory")
        for name in ("distill_temperature", "distill_weight"):
            if getattr(self, name) is not None and self.teacher == "none":
                raise ValueError(f"--{name.replace('_', '-')} needs a teacher (--teacher auto or DIR)")
        check_positive("distill_temperature", self.distill_temperature, allow_none=True)
        w = self.distill_weight
        if w is not None and not (isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w <= 1):
            raise ValueError(f"--distill-weight must be between 0 and 1, got {w!r}")
        rank = self.lora_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"--lora-rank must be a positive integer, got {rank!r}")
        if rank is None and self.lora_targets:
            raise ValueError("--lora-targets needs --lora-rank")
        if rank is not None and self.trainable not in (None, "all"):
            raise ValueError("--lora-rank trains only its adapters; leave out --trainable")
        if rank is not None and self.relative_lr is not None:
            raise ValueError(
                "--relative-lr scales each tensor by its RMS, and LoRA's B starts at 0; use --lr"
            )

    def with_defaults(self, config: dict) -> HealSettings:
        """These settings with --trainable, --seq-len and --lr that were left out set for the checkpoint
        whose config.json is `config` (`STEP_DEFAULTS`; LoRA takes the general ones)."""
        defaults = STEP_DEFAULTS["other" if self.lora_rank else checkpoint_kind(config)]
        given = {"trainable": self.trainable, "seq_len": self.seq_len, "lr": self.lr}
        chosen = {name: getattr(defaults, name) for name, value in given.items() if value is None}
        return replace(self, **chosen)

    def paths(self) -> tuple[Path, Path]:
        """(output, state dir) as absolute paths."""
        output = Path(self.output).expanduser().absolute()
        state = Path(self.state_dir).expanduser().absolute() if self.state_dir else default_state_dir(output)
        return output, state

    def record(self) -> dict:
        """The settings as JSON values (paths as strings), for the conversion record."""
        return json.loads(json.dumps(asdict(self), default=str))


@dataclass(frozen=True)
class HealData:
    """The tokenized training chunks and held-out ids (None: no evaluation), with their corpora."""

    train_corpus: Corpus
    train_tokens: int
    chunks: torch.Tensor  # (N, seq_len)
    eval_corpus: Corpus
    eval_ids: torch.Tensor | None  # (eval_tokens,)
    train_sha256: str  # the training stream: its text, and the corpora's equal shares where it has several


def load_data(settings: HealSettings, source: Path, *, num_processes: int) -> HealData:
    """Tokenize the training text once (cut into `seq_len` chunks) and the held-out text; they must not
    overlap (`check_disjoint`)."""
    s = settings
    corpus = s.train_corpus or (None if s.train_text or s.dataset else DEFAULT_TRAIN_CORPUS)
    part_files = assets.corpus_parts(corpus) if corpus else [s.train_text]
    if len(part_files) > 1:  # the corpora of `mix`, each read once; the training text is their join
        parts = [load_corpus(files) for files in part_files]
        train_files = [f for files in part_files for f in files]
        names = "+".join(f.name for f in train_files)
        train_corpus = Corpus.from_text(SEPARATOR.join(part.text for part in parts), names)
    else:
        train_corpus, train_files = load_train_corpus(
            part_files[0],
            dataset=s.dataset,
            dataset_config=s.dataset_config,
            split=s.dataset_split,
            text_column=s.text_column,
        )
        parts = [train_corpus]
    eval_corpus, eval_files = load_eval_corpus(s.eval_text)
    check_disjoint(train_corpus, train_files, eval_corpus, eval_files)
    check_not_embedded_eval(train_corpus, train_files)
    tokenizer = loading.load_tokenizer(source)
    rows = loading.vocab_size(loading.load_config(source))
    part_ids = [tokenize(tokenizer, part) for part in parts]
    for ids in part_ids:
        loading.check_token_ids(ids, rows, tokenizer=tokenizer)
    min_chunks = s.batch_size * num_processes * s.grad_accum
    chunks = equal_shares([chunk_tokens(ids, s.seq_len, min_chunks=min_chunks) for ids in part_ids])
    shares = " ".join(["equal-shares", *(part.sha256 for part in parts)])
    stream = train_corpus.sha256 if len(parts) == 1 else hashlib.sha256(shares.encode()).hexdigest()
    eval_ids = tokenize(tokenizer, eval_corpus)[: s.eval_tokens] if s.eval_tokens else None
    if eval_ids is not None:
        loading.check_token_ids(eval_ids, rows, tokenizer=tokenizer)
        if eval_ids.numel() < s.eval_context:
            raise ValueError(
                f"The evaluation text {eval_corpus.name} has {eval_ids.numel()} tokens (--eval-tokens "
                f"{s.eval_tokens}), fewer than one window of {s.eval_context}; give a longer --eval-text or "
                "lower --eval-tokens / --eval-context"
            )
    train_tokens = sum(int(ids.numel()) for ids in part_ids)
    return HealData(train_corpus, train_tokens, chunks, eval_corpus, eval_ids, stream)


def equal_shares(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Chunks of several corpora (each (N_i, L)) -> (P x max N_i, L): each corpus's chunks repeated in turn
    up to the largest one's count, so that every corpus gives an equal share of the training stream."""
    most = max(len(p) for p in parts)
    return torch.cat([p[torch.arange(most) % len(p)] for p in parts])  # (P * most, L)


def make_recipe(
    settings: HealSettings,
    data: HealData,
    *,
    num_processes: int,
    source_hash: str,
    teacher_hash: str | None = None,
    lora_targets: tuple[str, ...] = (),
) -> HealRecipe:
    """The recipe of a run; `teacher_hash`: the resolved teacher's weights (None: labels only);
    `lora_targets`: the resolved names of the modules LoRA adapts (with `lora_rank`)."""
    s = settings
    total_steps = plan_budget(
        max_steps=s.max_steps,
        max_tokens=s.max_tokens,
        max_minutes=s.max_minutes,
        tokens_per_step=s.batch_size * num_processes * s.grad_accum * s.seq_len,
    )
    teacher = teacher_hash is not None
    same = (
        "seq_len batch_size grad_accum lr relative_lr warmup_steps weight_decay trainable autocast_dtype seed"
    )
    return HealRecipe(
        **{name: getattr(s, name) for name in same.split()},  # the settings' own values
        num_processes=num_processes,
        schedule=resolve_schedule(s.schedule, total_steps),
        total_steps=total_steps,
        max_grad_norm=s.max_grad_norm or None,
        train_sha256=data.train_sha256,
        source_hash=source_hash,
        teacher_hash=teacher_hash,
        distill_temperature=_default(s.distill_temperature, DEFAULT_DISTILL_TEMPERATURE) if teacher else None,
        distill_weight=_default(s.distill_weight, DEFAULT_DISTILL_WEIGHT) if teacher else None,
        lora_rank=s.lora_rank,
        lora_targets=",".join(lora_targets) if s.lora_rank else None,
    )


def _default(value, default):
    return default if value is None else value
