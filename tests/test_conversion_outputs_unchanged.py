"""Every converter writes the recorded reference: a tiny random Llama converted by gqa (mean and calibrated),
mla (default and the DeepSeek layout), expand, export (to deepseek_v3) and refine (two steps).

Every output tensor is either a byte-for-byte copy of a source tensor (the reference names which one) or
computed (the reference holds its values, `tests/data/conversion_reference.safetensors`). A copy must be
exact; a computed tensor must match to 1e-4 of its largest magnitude. The tolerance is for the machine, not
the code: another CPU's vector kernels round the same sums differently (measured: at most 1e-5 of the
largest magnitude between torch's AVX2 and default kernels, `ATEN_CPU_CAPABILITY`), where a changed recipe
moves a computed tensor by far more. A change that is meant to change the numbers rewrites the reference:

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

DATA = Path(__file__).resolve().parent / "data"
REFERENCE, VALUES = DATA / "conversion_reference.json", DATA / "conversion_reference.safetensors"
TOLERANCE = 1e-4  # of the tensor's largest magnitude
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


def load_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """name -> tensor, every tensor of the checkpoint in `directory`."""
    return {n: t for f in sorted(directory.glob("*.safetensors")) for n, t in load_file(f).items()}


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)} ".encode())
    h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def convert_all(root: Path, tokenizer_dir: Path) -> tuple[Path, dict[str, Path]]:
    """Every converter's output on the tiny source: (the source, case -> output directory)."""
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
        return src, {case: Path(out) for case, out in outputs.items()}
    finally:
        torch.set_num_threads(threads)


def record(source: dict, outputs: dict) -> tuple[dict, dict]:
    """The reference: case -> tensor name -> the source tensor it copies (None: computed), and the computed
    tensors' values under `case/name`."""
    copies = {digest(t): name for name, t in sorted(source.items(), reverse=True)}
    reference, values = {}, {}
    for case, tensors in outputs.items():
        reference[case] = {name: copies.get(digest(t)) for name, t in sorted(tensors.items())}
        values.update({f"{case}/{n}": t for n, t in tensors.items() if reference[case][n] is None})
    return reference, values


def mismatches(source: dict, outputs: dict, reference: dict, values: dict) -> list[str]:
    """`case/name` of every output tensor that differs from the reference (names checked first)."""
    bad = [case for case in reference if sorted(outputs.get(case, ())) != sorted(reference[case])]
    for case, names in reference.items():
        for name, copied in names.items() if case not in bad else ():
            got = outputs[case][name]
            if copied is not None:
                same = digest(got) == digest(source[copied])
            else:
                want = values[f"{case}/{name}"]
                scale = want.abs().max().item()
                same = got.dtype == want.dtype and got.shape == want.shape
                same = same and (got - want).abs().max().item() <= TOLERANCE * scale
            bad += [] if same else [f"{case}/{name}"]
    return bad


def converted(root: Path, tokenizer_dir: Path) -> tuple[dict, dict]:
    """(source tensors, case -> output tensors) of `convert_all`."""
    src, outputs = convert_all(root, tokenizer_dir)
    return load_tensors(src), {case: load_tensors(out) for case, out in outputs.items()}


def test_every_converter_writes_the_reference_tensors(tmp_path, smollm2_path):
    reference = json.loads(REFERENCE.read_text())
    source, outputs = converted(tmp_path, smollm2_path)
    assert sorted(outputs) == sorted(reference)
    assert mismatches(source, outputs, reference, load_file(VALUES)) == []


def test_the_comparison_sees_one_ulp_in_a_copy_and_a_small_change_in_a_computed_tensor():
    g = torch.Generator().manual_seed(0)
    source = {"a": torch.randn(8, 8, generator=g), "b": torch.randn(8, 8, generator=g)}
    outputs = {"case": {"a": source["a"].clone(), "c": torch.randn(8, 8, generator=g)}}
    reference, values = record(source, outputs)
    assert reference == {"case": {"a": "a", "c": None}} and list(values) == ["case/c"]
    assert mismatches(source, outputs, reference, values) == []
    a = outputs["case"]["a"]
    a[0, 0] = torch.nextafter(a[0, 0], torch.tensor(float("inf")))  # one weight, one ulp
    outputs["case"]["c"] = outputs["case"]["c"] * (1 + 3 * TOLERANCE)
    assert mismatches(source, outputs, reference, values) == ["case/a", "case/c"]
    assert mismatches(source, {"case": {"a": a}}, reference, values) == ["case"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_conversion_outputs_unchanged.py --write")
    import tempfile

    from safetensors.torch import save_file

    from hf_attn.tooling import assets

    with tempfile.TemporaryDirectory() as tmp:
        reference, values = record(*converted(Path(tmp), assets.smollm2_dir()))
    DATA.mkdir(exist_ok=True)
    REFERENCE.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")
    save_file({k: t.contiguous() for k, t in sorted(values.items())}, VALUES)
    print(f"wrote {REFERENCE} and {VALUES}: {len(values)} computed tensors")
