"""Local accuracy tasks built offline from the evaluation novel (*Persuasion*), never from calibration text:
two JSON-lines files of `N_ITEMS` items, built deterministically (seeded) and kept with the other assets:

    $HF_ATTN_CACHE/tasks/v<BUILDER_VERSION>/
      persuasion_lastword.jsonl    {"id", "context", "target"}: LAMBADA-style last-word prediction
      persuasion_nextsent.jsonl    {"id", "context", "choices", "label"}: next sentence among distractors
      SHA256SUMS                   pinned (`TASK_SHA256`) and verified on build and on every access, so a
                                   damaged file, a changed novel or builder never silently gives other numbers

Protocol (all on *Persuasion* as `hf_attn.tooling.assets` stores it):
- Text: paragraphs are the blocks between blank lines, their lines joined by one space; chapter headings are
  dropped (contexts never cross one). Sentences end at `.`, `!` or `?` (plus closing quotes) followed by a
  space and an upper-case letter (or an opening quote).
- lastword: every sentence whose final word (the target: letters only, at least `MIN_TARGET_LETTERS` of
  them, sentence punctuation stripped) also occurs earlier in the context (LAMBADA's broad-context property,
  checked case-insensitively) and whose context (the words from the earliest sentence start, across
  paragraphs of the same chapter, up to the target, exclusive) has `LASTWORD_CONTEXT_WORDS` words. `N_ITEMS`
  of these candidates are drawn with `random.Random(SEED)`. Scored as in lm-eval's `lambada_openai`:
  accuracy = the greedy continuation equals " " + target (every target token is the argmax); perplexity =
  exp(-mean over items of log p(" " + target | context)).
- nextsent: a paragraph sentence k >= 1 of `SENTENCE_WORDS` words is the true next sentence; its context is
  the preceding sentences of the same paragraph (the longest suffix of them within `NEXTSENT_CONTEXT_WORDS`
  words, at least its lower bound). The `N_CHOICES - 1` distractors are sentences of the same book at least
  `DISTRACTOR_MIN_PARAGRAPHS` paragraphs away whose length is within a factor `DISTRACTOR_LENGTH_RATIO` of the
  true one (so length alone does not give the answer); the true sentence's position is drawn uniformly. One
  candidate per paragraph (drawn with the seeded generator), then `N_ITEMS` of them. Scored as lm-eval's
  `multiple_choice`: acc = argmax of the summed log-likelihood of " " + choice; acc_norm divides by the
  choice's length in characters.
- Overlap: the source text must share no `OVERLAP_NGRAM`-word sequence (the GPT-3 decontamination length,
  lower-cased words) with the calibration / healing novels (`assets.TRAIN_NOVELS`); the builder raises
  otherwise, and refuses a calibration novel as its source outright.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from hf_attn.tooling import assets
from hf_attn.tooling.files import atomic_directory, sha256_file

BUILDER_VERSION = 1
SOURCE_NOVEL = assets.EVAL_NOVEL
TASKS = ("persuasion_lastword", "persuasion_nextsent")
SEED = 20261123
N_ITEMS = 200
MIN_TARGET_LETTERS = 4
LASTWORD_CONTEXT_WORDS = (25, 90)
SENTENCE_WORDS = (6, 30)
NEXTSENT_CONTEXT_WORDS = (10, 40)
N_CHOICES = 4
DISTRACTOR_MIN_PARAGRAPHS = 20
DISTRACTOR_LENGTH_RATIO = 1.34
OVERLAP_NGRAM = 13

TASK_SHA256 = {  # of each task file as built from the checksummed *Persuasion*
    "persuasion_lastword": "fd667921f57a36ab9b27f8b089620031f5da6018275fe4ec205204d3a5b20893",
    "persuasion_nextsent": "78929d30af7deeaf85fe4279a39058d45c179fc47c8d70331dc12f959f83b98e",
}

_ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Messrs.", "Col.", "Capt.")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s+[\"'(]?[A-Z])")  # its closing quotes stay in the sentence
_HEADING = re.compile(r"^(chapter|volume)\b", re.IGNORECASE)
_TARGET = re.compile(r"^([A-Za-z]+)[.!?]+[\"')\]]*$")
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


@dataclass(frozen=True)
class Paragraph:
    index: int  # position among the kept paragraphs
    chapter: int  # number of chapter headings before it
    sentences: tuple[str, ...]


def paragraphs(text: str) -> list[Paragraph]:
    """Blank-line separated blocks, whitespace collapsed, split in sentences; chapter headings dropped (they
    start a new chapter)."""
    out, chapter = [], 0
    for block in re.split(r"\n\s*\n", text):
        flat = " ".join(block.split())
        if _HEADING.match(flat):
            chapter += 1
        elif flat:
            out.append(Paragraph(len(out), chapter, tuple(split_sentences(flat))))
    return out


def split_sentences(paragraph: str) -> list[str]:
    ends = [match.end() for match in _SENTENCE_END.finditer(paragraph)]
    pieces = [paragraph[start:end] for start, end in zip([0, *ends], [*ends, None])]
    merged: list[str] = []
    for piece in pieces:
        if merged and merged[-1].endswith(_ABBREVIATIONS):
            merged[-1] += piece  # the piece keeps its leading space
        else:
            merged.append(piece)
    return [s.strip() for s in merged if s.strip()]


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _ngram_hashes(words: list[str], n: int) -> list[bytes]:
    """The hash of each `n`-word sequence of `words`, in order."""
    return [
        hashlib.blake2b(" ".join(words[i : i + n]).encode(), digest_size=8).digest()
        for i in range(len(words) - n + 1)
    ]


def check_no_overlap(source: str, forbidden: str, *, n: int = OVERLAP_NGRAM) -> None:
    """ValueError if `source` shares any `n`-word sequence (lower-cased words) with `forbidden`."""
    words = _words(source)
    hashes = _ngram_hashes(words, n)
    shared = set(hashes) & set(_ngram_hashes(_words(forbidden), n))
    if shared:
        first = next(i for i, h in enumerate(hashes) if h in shared)
        example = " ".join(words[first : first + n])
        raise ValueError(
            f"The task source shares {len(shared)} {n}-word sequence(s) with the calibration/healing text "
            f"(e.g. {example!r}); build the tasks from text that is never used for calibration or healing"
        )


def build_lastword(paras: list[Paragraph], *, n_items: int = N_ITEMS, seed: int = SEED) -> list[dict]:
    """LAMBADA-style items {"id", "context", "target"} (see the module docstring for the selection)."""
    lo, hi = LASTWORD_CONTEXT_WORDS
    words: list[str] = []  # the paragraphs' words as one stream
    starts: list[int] = []  # word index where each sentence starts
    chapters: list[int] = []  # its chapter: contexts do not cross a chapter heading
    for para in paras:
        for sentence in para.sentences:
            starts.append(len(words))
            chapters.append(para.chapter)
            words.extend(sentence.split())
    starts.append(len(words))
    candidates = []
    for k in range(len(starts) - 1):
        end = starts[k + 1] - 1  # index of the sentence's last word
        match = _TARGET.match(words[end])
        if match is None or len(match.group(1)) < MIN_TARGET_LETTERS:
            continue
        target = match.group(1)
        begin = next(  # the longest context
            (s for s, c in zip(starts[: k + 1], chapters) if c == chapters[k] and lo <= end - s <= hi), None
        )
        if begin is None:
            continue
        context = " ".join(words[begin:end])
        if target.lower() in set(_words(context)):
            candidates.append((context, target))
    return _draw(candidates, n_items, seed, ("context", "target"), "lastword")


def build_nextsent(paras: list[Paragraph], *, n_items: int = N_ITEMS, seed: int = SEED) -> list[dict]:
    """Multiple-choice items {"id", "context", "choices", "label"} (see the module docstring)."""
    rng = random.Random(seed)
    slo, shi = SENTENCE_WORDS
    clo, chi = NEXTSENT_CONTEXT_WORDS
    pool = [(p.index, s) for p in paras for s in p.sentences if slo <= len(s.split()) <= shi]  # distractors
    candidates = []
    for para in paras:
        options = []
        for k in range(1, len(para.sentences)):
            true = para.sentences[k]
            if not slo <= len(true.split()) <= shi:
                continue
            context, j = [], k - 1
            while j >= 0 and len(" ".join([para.sentences[j], *context]).split()) <= chi:
                context.insert(0, para.sentences[j])
                j -= 1
            if context and len(" ".join(context).split()) >= clo:
                options.append((" ".join(context), true))
        if not options:
            continue
        context, true = options[rng.randrange(len(options))]
        n = len(true.split())
        eligible = [  # unique, book order
            s
            for s in dict.fromkeys(s for i, s in pool if abs(i - para.index) >= DISTRACTOR_MIN_PARAGRAPHS)
            if n / DISTRACTOR_LENGTH_RATIO <= len(s.split()) <= n * DISTRACTOR_LENGTH_RATIO and s != true
        ]
        if len(eligible) < N_CHOICES - 1:
            continue
        choices = rng.sample(eligible, N_CHOICES - 1)
        label = rng.randrange(N_CHOICES)
        choices.insert(label, true)
        candidates.append((context, choices, label))
    return _draw(candidates, n_items, seed, ("context", "choices", "label"), "nextsent")


def _draw(candidates: list[tuple], n_items: int, seed: int, keys: tuple[str, ...], name: str) -> list[dict]:
    """`n_items` of the `candidates` drawn with `random.Random(seed)`, in book order, as {"id", *keys}."""
    if len(candidates) < n_items:
        raise ValueError(f"Only {len(candidates)} {name} candidates in the source, fewer than {n_items}")
    chosen = sorted(random.Random(seed).sample(range(len(candidates)), n_items))  # book order
    return [{"id": i, **dict(zip(keys, candidates[c]))} for i, c in enumerate(chosen)]


def build_tasks(
    text: str, forbidden: str, *, n_items: int = N_ITEMS, seed: int = SEED
) -> dict[str, list[dict]]:
    """Both tasks from `text`; ValueError if `text` overlaps the calibration/healing text `forbidden`."""
    check_no_overlap(text, forbidden)
    paras = paragraphs(text)
    return {
        "persuasion_lastword": build_lastword(paras, n_items=n_items, seed=seed),
        "persuasion_nextsent": build_nextsent(paras, n_items=n_items, seed=seed),
    }


def to_jsonl(items: list[dict]) -> bytes:
    return "".join(json.dumps(it, ensure_ascii=False, sort_keys=True) + "\n" for it in items).encode("utf-8")


def build_from_assets(source_novel: str = SOURCE_NOVEL) -> dict[str, bytes]:
    """The task files' bytes built from a stored novel; refuses a calibration/healing novel."""
    if source_novel in assets.TRAIN_NOVELS:
        raise ValueError(
            f"{source_novel!r} is calibration/healing text; build the tasks from {assets.EVAL_NOVEL!r}"
        )
    text = assets.austen_file(source_novel).read_text(encoding="utf-8")
    forbidden = "\n\n".join(p.read_text(encoding="utf-8") for p in assets.train_text_files())
    return {name: to_jsonl(items) for name, items in build_tasks(text, forbidden).items()}


def task_dir() -> Path:
    """Directory of the task files; built on first use, checksums verified on every access."""
    final = assets.cache_dir() / "tasks" / f"v{BUILDER_VERSION}"
    if not (final / "SHA256SUMS").exists():
        files = build_from_assets()
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        for name, digest in digests.items():
            if digest != TASK_SHA256[name]:  # nothing is written
                raise OSError(
                    f"The built {name} differs from the pinned checksum ({digest} != {TASK_SHA256[name]}); "
                    "the novel or the builder changed: check them (or update TASK_SHA256 and BUILDER_VERSION)"
                )
        with atomic_directory(final, overwrite=True) as tmp:
            for name, data in files.items():
                (tmp / f"{name}.jsonl").write_bytes(data)
            (tmp / "SHA256SUMS").write_text("".join(f"{digests[name]}  {name}.jsonl\n" for name in files))
    _verify(final)
    return final


def _verify(directory: Path) -> None:
    for name in TASKS:
        path = directory / f"{name}.jsonl"
        digest = sha256_file(path) if path.exists() else None
        if digest != TASK_SHA256[name]:
            raise OSError(
                f"{path} is missing or differs from the pinned checksum ({digest} != {TASK_SHA256[name]}); "
                f"delete {directory} to rebuild it (and check that the novel and the builder are unchanged)."
            )


def task_file(name: str) -> Path:
    if name not in TASKS:
        raise ValueError(f"Unknown local task {name!r}; choose one of {list(TASKS)}")
    return task_dir() / f"{name}.jsonl"


def load_items(name: str) -> list[dict]:
    """The verified items of one local task."""
    with task_file(name).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def dataset_dict(name: str):
    """`datasets.DatasetDict({"test": ...})` of one task (what lm-eval's `custom_dataset` returns)."""
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(load_items(name))})


def main() -> None:
    print(f"tasks: {task_dir()}")


if __name__ == "__main__":
    main()
