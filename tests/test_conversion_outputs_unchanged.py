"""Every converter writes the same tensors as the recorded reference: a tiny random Llama converted by gqa
(mean and calibrated), mla (default and the DeepSeek layout), expand, export (to deepseek_v3) and refine
(two steps), each output tensor's sha256 compared with `tests/data/conversion_hashes.json`.

The reference pins the numbers of the converters while their code is reorganised; a change that is meant
to change them rewrites it:

    python tests/test_conversion_outputs_unchanged.py --write
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch
from conftest import TINY_SHAPE
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

REFERENCE = Path(__file__).resolve().parent / "data" / "conversion_hashes.json"
SHAPE = dict(  # conftest.TINY_SHAPE with SmolLM2's vocabulary (so that calibration text tokenizes)
    **TINY_SHAPE, vocab_size=49152, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True
)
TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. The hallway smelt of boiled "
    "cabbage and old rag mats. At one end of it a coloured poster, too large for indoor display, had been "
    "tacked to the wall. " * 40
)


def make_source(root: Path, tokenizer_dir: Path) -> tuple[Path, Path]:
    """The tiny random Llama (with SmolLM2's tokenizer files) and a calibration text file."""
    src = root / "source"
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=torch.float32)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, src / name)
    text = root / "calibration.txt"
    text.write_text(TEXT)
    return src, text


def tensor_hashes(directory: Path) -> dict[str, str]:
    """name -> sha256 of dtype, shape and bytes of every tensor of the checkpoint in `directory`."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        for name, t in load_file(f).items():
            h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)} ".encode())
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            out[name] = h.hexdigest()
    return dict(sorted(out.items()))


def convert_all(root: Path, tokenizer_dir: Path) -> dict[str, dict[str, str]]:
    """Every converter's output on the tiny source: case -> tensor name -> sha256."""
    from hf_attn.conversion import export, gqa, mla, refine
    from hf_attn.conversion.gqa.expand import expand_checkpoint
    from hf_attn.conversion.specs import CalibrationSpec, ExpandSpec, GQASpec, MLASpec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one summation order in every run
    try:
        src, text = make_source(root, tokenizer_dir)
        calibration = CalibrationSpec(text=(str(text),), tokens=256, window=128, device="cpu")
        outputs = {
            "gqa-mean": gqa.convert_gqa(GQASpec(num_kv_heads=1, method="mean"), src=src, dst=root / "gm"),
            "gqa-calibrated": gqa.convert_gqa(
                GQASpec(num_kv_heads=1), src=src, dst=root / "gc", calibration=calibration
            ),
            "mla-default": mla.convert_to_mla(MLASpec(), src=src, dst=root / "md", calibration=calibration),
            "mla-deepseek": mla.convert_to_mla(
                MLASpec(layout="deepseek"), src=src, dst=root / "mds", calibration=calibration
            ),
            "expand": expand_checkpoint(ExpandSpec(), src=src, dst=root / "ex"),
        }
        outputs["export"] = export.export_checkpoint(src=outputs["mla-deepseek"], dst=root / "ds3")
        settings = refine.RefineSettings(
            model=str(outputs["gqa-mean"]),
            output=str(root / "rf"),
            steps=2,
            loss_stride=1,
            step_dtype="float32",
            calibration_text=[str(text)],
            calibration_tokens=256,
            device="cpu",
        )
        refine.refine(settings, progress=False)
        outputs["refine"] = root / "rf"
        return {case: tensor_hashes(Path(out)) for case, out in outputs.items()}
    finally:
        torch.set_num_threads(threads)


def test_every_converter_writes_the_reference_tensors(tmp_path, smollm2_path):
    reference = json.loads(REFERENCE.read_text())
    got = convert_all(tmp_path, smollm2_path)
    assert sorted(got) == sorted(reference)
    for case, hashes in reference.items():
        assert sorted(got[case]) == sorted(hashes), f"{case}: other tensor names"
        changed = [name for name, h in hashes.items() if got[case][name] != h]
        assert not changed, f"{case}: tensors changed: {changed}"


def test_a_changed_weight_changes_its_hash(tmp_path):
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**SHAPE, "vocab_size": 64}), dtype=torch.float32)
    model.save_pretrained(tmp_path / "a")
    with torch.no_grad():
        w = model.model.layers[0].self_attn.k_proj.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf")))  # one weight, one ulp
    model.save_pretrained(tmp_path / "b")
    a, b = tensor_hashes(tmp_path / "a"), tensor_hashes(tmp_path / "b")
    assert [n for n in a if a[n] != b[n]] == ["model.layers.0.self_attn.k_proj.weight"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_conversion_outputs_unchanged.py --write")
    import tempfile

    from hf_attn.tooling import assets

    with tempfile.TemporaryDirectory() as tmp:
        hashes = convert_all(Path(tmp), assets.smollm2_dir())
    REFERENCE.parent.mkdir(exist_ok=True)
    REFERENCE.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    print(f"wrote {REFERENCE}: {sum(map(len, hashes.values()))} tensors")
