"""Rewrite the default calibration files so that any prefix samples the whole file
(docs/research/cross-domain.md).

    python -m benchmarks.experiments.calibration_spread OUT_DIR [PHASE]

`calibration_ids` reads each file's token share from the file's start. This writes, for every file of the
default calibration text, OUT_DIR/NAME: 64 chunks of 256 tokens taken at offsets (v_k + PHASE) mod 1 of the
file, v_k the van der Corput sequence 0, 1/2, 1/4, 3/4, ... (so a prefix of any length is spread over the
file), decoded and joined by blank lines. PHASE (default 0) picks another sample of the same design.
"""

import sys
from pathlib import Path

from transformers import AutoTokenizer

from hf_attn.conversion.checkpoint import calibration as cal
from hf_attn.tooling import assets

CHUNK, CHUNKS = 256, 64


def van_der_corput(k: int) -> float:
    x, scale = 0.0, 1.0
    while k:
        scale /= 2
        x += (k & 1) * scale
        k >>= 1
    return x


out, phase = Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
out.mkdir(parents=True, exist_ok=True)
tokenizer = AutoTokenizer.from_pretrained(assets.smollm2_dir())
for path in cal.default_calibration_files():
    ids = tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    n = len(ids) // CHUNK
    starts: list[int] = []
    k = 0
    while len(starts) < min(n, CHUNKS):
        j = int(((van_der_corput(k) + phase) % 1.0) * n)
        k += 1
        if j not in starts:
            starts.append(j)
    chunks = [tokenizer.decode(ids[j * CHUNK : (j + 1) * CHUNK]) for j in starts]
    (out / path.name).write_text("\n\n".join(chunks), encoding="utf-8")
    print(f"{path.name}: {len(ids)} tokens, {len(chunks)} chunks")
