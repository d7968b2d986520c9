"""Write what follows the scored part of each evaluation text: the same-document bound
(docs/research/cross-domain.md).

    python -m benchmarks.experiments.cross_domain_rest_of_text OUT_DIR

The cross-domain protocol scores the first 8,192 tokens of *Persuasion* and of the Python FAQ. This writes
OUT_DIR/persuasion_rest.txt and OUT_DIR/faq_rest.txt: each text from token 8,256 on (a 64-token margin),
cut at a token's first character, so nothing the protocol scores is in them. Calibration text for a
measurement of what genre-matched text can do, never for a shipped conversion.
"""

import sys
from pathlib import Path

from transformers import AutoTokenizer

from hf_attn.tooling import assets

SCORED, MARGIN = 8192, 64

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
tokenizer = AutoTokenizer.from_pretrained(assets.smollm2_dir())
texts = {"persuasion": assets.eval_text_files()[0], "faq": assets.python_docs_eval_file()}
for name, path in texts.items():
    text = path.read_text(encoding="utf-8")
    offsets = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    cut = offsets[SCORED + MARGIN][0]
    (out / f"{name}_rest.txt").write_text(text[cut:], encoding="utf-8")
    print(f"{name}: {len(offsets)} tokens, rest from character {cut}")
