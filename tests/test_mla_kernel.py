"""The Triton MLA decode kernel (`hf_attn.kernels.mla_decode`) against an independent float64 reference, run
under Triton's CPU interpreter, and `llama_mla`'s dispatch to it.

The interpreter must be switched on (TRITON_INTERPRET=1) before the kernels are defined, and only for them: so
every interpreted computation runs in ONE child process (this file run as a script, `worker` mode), which
prints error figures as JSON; the tests here assert on them. Reference: scores, masks, softmax and the
weighted latent sum written out in float64 with einsum (RoPE keys expanded per KV head), independent of both
the kernel and the model code. Precision rule (flash-attention's): in each dtype the kernel's max error
against the reference is at most 2x the error of the PyTorch absorbed path computed in that dtype.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (pip install hf-attn[kernels])")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# name -> shapes: B, Hkv, G (query heads per KV head), T, R (RoPE width), DC (latent width), S, Hr (RoPE-key
# heads), mask kind, a fully masked query row or not, num_splits (None: heuristic), block_n
CASES = {
    "T1_no_mask_rope_per_head": dict(
        B=2, Hkv=2, G=3, T=1, R=4, DC=24, S=40, Hr=2, mask="none", dead_row=False, splits=3, block_n=16
    ),
    "T3_bool_shared_rope": dict(
        B=2, Hkv=2, G=2, T=3, R=6, DC=20, S=37, Hr=1, mask="bool", dead_row=True, splits=2, block_n=16
    ),
    "additive_mqa_group": dict(
        B=1, Hkv=1, G=4, T=2, R=8, DC=32, S=50, Hr=1, mask="additive", dead_row=True, splits=4, block_n=16
    ),
    "no_rope": dict(
        B=2, Hkv=2, G=2, T=2, R=0, DC=12, S=19, Hr=2, mask="bool", dead_row=False, splits=2, block_n=16
    ),
    "rank80_rope2_heuristic_split": dict(
        B=1, Hkv=2, G=2, T=1, R=2, DC=80, S=33, Hr=2, mask="none", dead_row=False, splits=None, block_n=None
    ),
    "rank600_two_row_blocks": dict(  # 18 rows, 16 per block at DC 600: a block boundary inside KV head 1
        B=1, Hkv=2, G=3, T=3, R=4, DC=600, S=20, Hr=2, mask="bool", dead_row=False, splits=2, block_n=16
    ),
    "mask_broadcast_over_batch": dict(
        B=2, Hkv=3, G=1, T=2, R=4, DC=16, S=21, Hr=3, mask="additive_b1", dead_row=False, splits=1, block_n=16
    ),
}  # fmt: skip
# llama_mla models (fp32) decoded through the kernel vs the PyTorch absorbed path (config overrides). The
# shared RoPE key + latent norm case runs where the runtime has that layout (num_rope_keys), else skips.
MODEL_CASES = {
    "partial_rope_biases": dict(rope_pairs=2),
    "no_rope": dict(rope_pairs=0),
    "full_rope_no_nope": dict(rope_pairs=4),
    "shared_rope_latent_norm": dict(rope_pairs=3, rope_layout="shared", latent_norm=True),
}


# ------------------------------------------------------------------------------------------- references


def make_inputs(case: dict, dtype: torch.dtype, seed: int = 0):
    """Random q_rope, q_latent, latent, k_rope, mask (bool / additive in `dtype` / None) for a case."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G, T, R, DC, S, Hr = (case[k] for k in ("B", "Hkv", "G", "T", "R", "DC", "S", "Hr"))

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    q_rope, q_latent = rnd(B, Hkv, G, T, R), rnd(B, Hkv, G, T, DC, scale=DC**-0.25)
    latent, k_rope = rnd(B, 1, S, DC, scale=DC**-0.25), rnd(B, 1, S, Hr * R)
    keep = torch.rand(B, 1, T, S, generator=g) > 0.3  # (B, 1, T, S)
    keep[..., 0] = True
    if case["dead_row"]:
        keep[-1, 0, T - 1] = False  # the last batch row's last token attends to nothing
    if case["mask"] == "none":
        mask = None
    elif case["mask"] == "bool":
        mask = keep
    else:  # additive, transformers style: 0 / dtype min, plus a finite bias on kept keys
        bias = torch.randn(B, 1, T, S, generator=g).to(dtype)
        mask = torch.where(keep, bias, torch.finfo(dtype).min)
        if case["mask"] == "additive_b1":
            mask = mask[:1, :, :1]  # (1, 1, 1, S): broadcast over the batch and the query tokens
    return q_rope, q_latent, latent, k_rope, mask


def reference(q_rope, q_latent, latent, k_rope, mask, scaling):
    """float64: out (B, Hkv, G, T, DC) with zeros on rows without keys, lse (B, Hkv, G, T)."""
    B, Hkv, G, T, R = q_rope.shape
    S = latent.shape[2]
    Hr = k_rope.shape[-1] // R if R else 1
    c = latent[:, 0].double()  # (B, S, DC)
    kr = k_rope[:, 0].double().reshape(B, S, Hr, R).permute(0, 2, 1, 3).expand(B, Hkv, S, R)  # (B, Hkv, S, R)
    s = torch.einsum("bhgtr,bhsr->bhgts", q_rope.double(), kr)
    s = (s + torch.einsum("bhgtc,bsc->bhgts", q_latent.double(), c)) * scaling  # (B, Hkv, G, T, S)
    keep = torch.ones(B, 1, T, S, dtype=torch.bool)
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        s = s + mask.double().unsqueeze(2)
        keep = keep & (mask > torch.finfo(mask.dtype).min / 2)
    s = s.masked_fill(~keep.unsqueeze(2), -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, T), -inf on dead rows
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # dead rows: nan -> 0
    return torch.einsum("bhgts,bsc->bhgtc", p, c), lse


def torch_path(q_rope, q_latent, latent, k_rope, mask, scaling):
    """The PyTorch absorbed path's operations (`LlamaMLAAttention.absorbed_attention`) in the inputs' dtype:
    matmuls in dtype, scaling / mask / softmax in fp32, probabilities cast back for the latent sum."""
    B, Hkv, G, T, R = q_rope.shape
    S, DC = latent.shape[2], latent.shape[3]
    Hr = k_rope.shape[-1] // R if R else 1
    c = latent.squeeze(1)  # (B, S, DC)
    kr = k_rope.view(B, S, Hr, R).permute(0, 2, 3, 1)  # (B, Hr, R, S)
    scores = torch.matmul(q_rope.reshape(B, Hkv, G * T, R), kr)  # (B, Hkv, G*T, S)
    latent_scores = torch.matmul(q_latent.reshape(B, Hkv * G * T, DC), c.transpose(1, 2))  # (B, Hkv*G*T, S)
    scores = scores + latent_scores.view(B, Hkv, G * T, S)
    scores = scores.float().view(B, Hkv, G, T, S) * scaling
    keep = None
    if mask is not None and mask.dtype == torch.bool:
        keep = mask.unsqueeze(2)
    elif mask is not None:
        scores = scores + mask.float().unsqueeze(2)
        keep = (mask > torch.finfo(mask.dtype).min / 2).unsqueeze(2)
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(c.dtype)  # (B, Hkv, G, T, S)
    return torch.matmul(probs.view(B, Hkv * G * T, S), c).view(B, Hkv, G, T, DC)


# ------------------------------------------------------------------------- child process (interpreter)


def _kernel_results(mla_decode, device: str = "cpu") -> dict:
    results = {}
    for name, case in CASES.items():
        for dname, dtype in DTYPES.items():
            inputs = make_inputs(case, dtype)  # q_rope, q_latent, latent, k_rope, mask
            on_device = [None if t is None else t.to(device) for t in inputs]
            scaling = 0.37
            out, lse = mla_decode(
                *on_device, scaling=scaling, rope_heads=case["Hr"], return_lse=True,
                num_splits=case["splits"], block_n=case["block_n"],
            )  # fmt: skip
            out, lse = out.cpu(), lse.cpu()
            ref, ref_lse = reference(*inputs, scaling)
            pt = torch_path(*on_device, scaling).cpu()
            dead = torch.isinf(ref_lse)  # (B, Hkv, G, T)
            live = ~dead
            results[f"{name}/{dname}"] = {
                "dtype_ok": out.dtype == dtype and tuple(out.shape) == tuple(ref.shape),
                "err_kernel": (out.double() - ref).abs().max().item(),
                "err_torch": (pt.double() - ref).abs().max().item(),
                "scale": ref.abs().max().item(),
                "lse_err": (lse.double() - ref_lse)[live].abs().max().item(),
                "dead_rows": int(dead.sum()),
                "dead_rows_zero": bool((out[dead] == 0).all()) and bool(torch.isneginf(lse[dead]).all()),
                "finite": bool(torch.isfinite(out).all()),
            }
    return results


def tiny_mla_model(**overrides):
    from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM

    cfg = LlamaMLAConfig(
        vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=0, kv_lora_rank=10, attention_bias=True, **overrides,
    )  # fmt: skip
    torch.manual_seed(cfg.rope_pairs)
    model = LlamaMLAForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def _decode_logits(model, ids, mask, **kwargs) -> tuple[torch.Tensor, tuple | None]:
    """Prefill 5 tokens (absorbed path: T <= 16 with a cache), then one token at a time; (B, L, vocab)."""
    from transformers import DynamicCache

    cache, logits, attentions = DynamicCache(config=model.config), [], None
    for start, end in ((0, 5), (5, 6), (6, ids.shape[1])):
        out = model(
            input_ids=ids[:, start:end], attention_mask=mask[:, :end], past_key_values=cache, use_cache=True,
            **kwargs,
        )  # fmt: skip
        logits.append(out.logits)
        attentions = out.attentions if attentions is None else attentions
    return torch.cat(logits, dim=1), attentions


def _model_results(mla_decode, device: str = "cpu") -> dict:
    import hf_attn.models.llama_mla.modeling_llama_mla as modeling

    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return mla_decode(*args, **kwargs)

    ids = torch.randint(1, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding: the pad tokens' rows attend to nothing in the prefill
    ids, mask = ids.to(device), mask.to(device)
    results, original = {}, modeling.triton_mla_decode
    from hf_attn.models.llama_mla import LlamaMLAConfig

    for name, overrides in MODEL_CASES.items():
        if "rope_layout" in overrides and not hasattr(LlamaMLAConfig, "num_rope_keys"):
            results[name] = {"skipped": "this runtime has no shared RoPE layout"}
            continue
        model = tiny_mla_model(**overrides).to(device)
        with torch.no_grad():
            ref, _ = _decode_logits(model, ids, mask)
            calls.clear()
            modeling.triton_mla_decode = lambda latent: counting  # the kernel on CPU tensors
            try:
                got, _ = _decode_logits(model, ids, mask)
                kernel_calls = len(calls)
                calls.clear()
                _, attentions = _decode_logits(model, ids, mask, output_attentions=True)
                weights_calls = len(calls)
                calls.clear()
                with torch.enable_grad():  # autograd wanted: the PyTorch path (the kernel has no backward)
                    _decode_logits(model, ids, mask)
            finally:
                modeling.triton_mla_decode = original
        results[name] = {
            "diff": (got - ref).abs().max().item(),
            "scale": ref.abs().max().item(),
            "kernel_calls": kernel_calls,
            "calls_with_weights": weights_calls,
            "calls_with_autograd": len(calls),
            "weights_returned": attentions is not None and all(a is not None for a in attentions),
        }
    return results


def worker() -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (also set by the parent)
    torch.set_num_threads(1)
    import hf_attn  # noqa: F401

    loaded = any(m.startswith("hf_attn.kernels.") for m in sys.modules)  # by `import hf_attn`: must be False
    from hf_attn.kernels.mla_decode import mla_decode

    results = {"kernel": _kernel_results(mla_decode), "model": _model_results(mla_decode)}
    print(json.dumps({**results, "import_hf_attn_loads_kernel": loaded}))


@pytest.fixture(scope="module")
def interpreted():
    """Run every interpreted computation in one child process; its JSON results."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, __file__, "worker"], capture_output=True, text=True, env=env, cwd=root, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def compiled():
    """The same computations with the compiled kernel on the GPU, in this process."""
    from hf_attn.kernels.mla_decode import mla_decode

    return {"kernel": _kernel_results(mla_decode, "cuda"), "model": _model_results(mla_decode, "cuda")}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(interpreted, case, dtype):
    check_kernel_case(interpreted["kernel"][f"{case}/{dtype}"], case, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_kernel_matches_reference_on_gpu(compiled, case, dtype):
    check_kernel_case(compiled["kernel"][f"{case}/{dtype}"], case, dtype)


def check_kernel_case(r: dict, case: str, dtype: str) -> None:
    assert r["dtype_ok"] and r["finite"], r
    # flash-attention's rule, plus a floor of a few fp32 ulps for when the PyTorch path is nearly exact
    assert r["err_kernel"] <= 2 * r["err_torch"] + 1e-6 * r["scale"], r
    if dtype == "float32":
        assert r["err_kernel"] <= 1e-5 * r["scale"] and r["lse_err"] <= 1e-5, r
    assert r["dead_rows"] == (1 if CASES[case]["dead_row"] else 0) * CASES[case]["Hkv"] * CASES[case]["G"], r
    assert r["dead_rows_zero"], r


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_llama_mla_decode_through_kernel(interpreted, case):
    check_model_case(interpreted["model"][case])


@needs_cuda
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_llama_mla_decode_through_compiled_kernel_on_gpu(compiled, case):
    check_model_case(compiled["model"][case])


def check_model_case(r: dict) -> None:
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r["kernel_calls"] == 3 * 2, r  # 3 forward calls x 2 layers, all on the absorbed path
    assert r["diff"] <= 1e-5 * r["scale"], r
    assert r["calls_with_weights"] == 0 and r["weights_returned"], r  # output_attentions: the PyTorch path
    assert r["calls_with_autograd"] == 0, r


def test_import_hf_attn_does_not_load_the_kernel(interpreted):
    assert interpreted["import_hf_attn_loads_kernel"] is False


def test_compiles_for_a_gpu_without_one():
    """The interpreter does not lower to GPU code: compile the split kernel for sm_90 ahead of time (per-head
    RoPE keys, additive mask, bf16, Llama-3-8B shape defaults) to catch errors only the compiler sees."""
    from benchmarks.mla_kernel_registers import launch_config, ptxas_report
    from hf_attn.kernels import mla_decode

    if type(mla_decode._mla_decode_split).__name__ == "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET is set in this process")
    cfg = launch_config(512, 48, 32)
    report = ptxas_report(dtype="bfloat16", arch=90, per_head=True, has_rope=True, cfg=cfg, mask_kind=2)
    assert report["registers"] is not None and report["shared_bytes"] > 0, report


BAD_CALLS = {
    "latent_rank": (dict(latent=(2, 1, 9, 5)), "q_latent must be"),
    "rope_heads": (dict(k_rope=(2, 1, 9, 12)), "rope_heads 1"),
    "batch": (dict(latent=(1, 1, 9, 8)), "latent must be"),
    "dtype": (dict(dtype_latent=torch.float16), "share one dtype"),
    "head_mask": (dict(mask=(2, 2, 1, 9)), "per-head masks"),
    "int_mask": (dict(mask_dtype=torch.int64), "or additive float"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_inputs_raise_value_errors(name):
    from hf_attn.kernels.mla_decode import mla_decode

    change, message = BAD_CALLS[name]
    shapes = dict(q_rope=(2, 2, 3, 1, 4), q_latent=(2, 2, 3, 1, 8), latent=(2, 1, 9, 8), k_rope=(2, 1, 9, 8))
    shapes.update({k: v for k, v in change.items() if k in shapes})
    tensors = {k: torch.zeros(v) for k, v in shapes.items()}
    tensors["latent"] = tensors["latent"].to(change.get("dtype_latent", torch.float32))
    mask = torch.ones(change.get("mask", (2, 1, 1, 9)), dtype=change.get("mask_dtype", torch.bool))
    with pytest.raises(ValueError, match=message):
        mla_decode(**tensors, mask=mask, scaling=1.0)


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    worker()
