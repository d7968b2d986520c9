"""The second embedded corpus: the Python 3.11 documentation (technical prose), for cross-domain checks.

Source: Debian bookworm's `python3.11-doc` (PSF License Version 2; a 12.6 MB .deb), which ships the reST
sources of the docs as `SOURCES/<section>/*.rst.txt`. Each section used here becomes one UTF-8 text file: its
files in sorted path order, markup stripped deterministically (`strip_rest`), joined with blank lines.

    $HF_ATTN_CACHE/python-docs/<section>.txt   tutorial, reference, howto, using, extending: calibration
                                               faq: evaluation (never calibration or healing text)
    $HF_ATTN_CACHE/python-docs/SHA256SUMS      checksums, verified on every access

The derived texts are pinned (`PINNED_SHA256`): a different package build that changes them is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

DEB_PACKAGE = "python3.11-doc"
DEB_VERSION = "3.11.2-6+deb12u8"  # the build the pinned checksums were made from
SOURCES = "usr/share/doc/python3.11/html/_sources"
CALIBRATION_SECTIONS = ("tutorial", "reference", "howto", "using", "extending")
EVAL_SECTION = "faq"
SECTIONS = CALIBRATION_SECTIONS + (EVAL_SECTION,)
DIRNAME = "python-docs"

PINNED_SHA256 = {
    "tutorial": "5a7a5dace54bec7b6bb5afd7430c0ab3fa954c2eb52746950c17c4af64524602",
    "reference": "eb03ac86f4721ad795499ef4a4f3b2996dcdfb73bfabc7b181258f8bfc807eac",
    "howto": "1a51bcef75bc83c1afdb3c4304232d3d07620a37d37dfa9a40a2b782ded75bfd",
    "using": "c59781145f9363b2976c89e00f95731fc2a61b5c9f31a6609223499a0fa5a081",
    "extending": "2bd19ed46c0484bcb2535415ee7b3e2016ce132c42fa1e97aa6dd9c74caa4420",
    "faq": "c24dcb74b33c08a73fcb87df1cf370f985c1e00ab3002a101832f716d4474c02",
}

# directives whose whole indented block is navigation or metadata, not prose
_DROP_BLOCK = {
    "index", "toctree", "highlight", "sectionauthor", "moduleauthor", "tabularcolumns", "only", "contents",
    "testsetup", "testcleanup", "raw", "include", "literalinclude", "productionlist", "image", "figure",
}  # fmt: skip
_ADORNMENT = re.compile(r"^([=\-`:'\"~^_*+#<>.])\1{2,}\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\.(?:\s+([\w:-]+)::.*|\s.*|)$")  # ".. name:: args", ".. _target:", "..  x"
_FIELD = re.compile(r"^\s*:[\w -]+:(\s.*)?$")  # directive options (":noindex:", ":synopsis: ...")
_ROLE = re.compile(r":[\w:+.-]+:`([^`]*)`")
_LINK = re.compile(r"`([^`<]*?)\s*<[^`>]*>`__?")
_REF = re.compile(r"`([^`]+)`_{1,2}")
_LITERAL = re.compile(r"``([^`]+)``")


def _role_text(match: re.Match) -> str:
    text = match.group(1)
    titled = re.fullmatch(r"(.*?)\s*<[^<>]*>", text, flags=re.S)
    if titled and titled.group(1):
        text = titled.group(1)
    return text.lstrip("~!")


def strip_rest(source: str) -> str:
    """reST -> plain text: drop adornments, comments, navigation directives (with their blocks) and directive
    option lines; keep other directive bodies and code as they are; replace roles, links and literals by
    their text. Deterministic (regular expressions only)."""
    out: list[str] = []
    drop_indent: int | None = None  # inside a dropped block: lines indented deeper than this are dropped
    after_directive = False
    for line in source.splitlines():
        indent = len(line) - len(line.lstrip())
        if drop_indent is not None:
            if not line.strip() or indent > drop_indent:
                continue
            drop_indent = None
        directive = _DIRECTIVE.match(line)
        if directive:
            name = directive.group(2)
            if name is None or name in _DROP_BLOCK:  # comment / target / navigation: the block goes too
                drop_indent = indent
            after_directive = True
            continue
        if after_directive and _FIELD.match(line):
            continue
        after_directive = False
        if _ADORNMENT.match(line):
            continue
        line = _ROLE.sub(_role_text, line)
        line = _LINK.sub(r"\1", line)
        line = _LITERAL.sub(r"\1", line)
        line = _REF.sub(r"\1", line)
        if line.endswith("::"):
            line = line[:-2].rstrip() + (":" if line[:-2].strip() else "")
        out.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def build_texts(deb_root: Path) -> dict[str, str]:
    """section -> its plain text, from the extracted package (its `SOURCES` directory)."""
    sources, texts = deb_root / SOURCES, {}
    for section in SECTIONS:
        files = sorted((sources / section).rglob("*.rst.txt"))
        if not files:
            raise ValueError(f"{DEB_PACKAGE} has no {section}/*.rst.txt under {sources}")
        texts[section] = "\n".join(strip_rest(f.read_text(encoding="utf-8")) for f in files)
    return texts


def check_pinned(section: str, digest: str, debs: Path) -> None:
    """OSError unless `digest` (sha256 of `section`.txt, made from the .deb in `debs`) is the pinned one."""
    if PINNED_SHA256[section] and digest != PINNED_SHA256[section]:
        versions = sorted(p.name for p in debs.glob("*.deb"))
        raise OSError(
            f"{section}.txt from {versions} has sha256 {digest[:12]}, not the pinned "
            f"{PINNED_SHA256[section][:12]} (made from {DEB_PACKAGE} {DEB_VERSION}); the package "
            "changed: fetch that version or update PINNED_SHA256 in hf_attn/tooling/python_docs.py"
        )
