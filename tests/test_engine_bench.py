"""`python -m benchmarks.engine`: the cache arithmetic, and a quick run in vLLM whose KV-cache capacity must
equal the arithmetic computed here from the checkpoints' tensor shapes (not from the code under test).

The quick run needs the engine environment (`make engine`); without it that test is skipped with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from benchmarks.engine import bench, bench_report


def test_cache_bytes_per_token_llama2_7b_and_its_576_export():
    llama = dict(model_type="llama", num_hidden_layers=2, hidden_size=4096, num_attention_heads=32,
                 num_key_value_heads=32, head_dim=128)  # fmt: skip
    mla = dict(model_type="deepseek_v3", num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64)
    assert bench.cache_bytes_per_token(llama, 2) == 2 * 2 * 32 * 128 * 2
    assert bench.cache_bytes_per_token(mla, 2) == 2 * 576 * 2
    assert bench.cache_bytes_per_token(llama, 2) / bench.cache_bytes_per_token(mla, 2) == pytest.approx(
        8192 / 576
    )


def _cache_width_from_weights(model: Path) -> int:
    """Numbers cached per token, summed over layers, read from the weights: K and V rows of a Llama layer,
    the rows of DeepSeek's kv_a_proj_with_mqa (latent + RoPE key)."""
    total = 0
    for shard in model.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                if name.endswith(
                    ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "kv_a_proj_with_mqa.weight")
                ):
                    total += f.get_slice(name).get_shape()[0]
    return total


@pytest.fixture(scope="module")
def quick_rows(tmp_path_factory):
    try:
        from hf_attn.eval.engine.environment import EngineUnavailable, engine_python

        engine_python()
    except (ImportError, EngineUnavailable) as err:
        pytest.skip(f"no engine environment: {err}")
    work = tmp_path_factory.mktemp("engine-bench")
    out = work / "rows.json"
    assert bench.main(["--quick", "--workdir", str(work), "--output", str(out), "--cpu-threads", "1"]) == 0
    return work, json.loads(out.read_text())


def test_quick_capacity_equals_the_weights_arithmetic(quick_rows):
    work, rows = quick_rows
    assert {r["model"] for r in rows} == {"source", "mla"}
    for row in rows:
        model = work / "tiny" / ("source" if row["model"] == "source" else "export")
        cap = row["capacity"]
        per_token = _cache_width_from_weights(model) * 2  # numbers per token (all layers) x bfloat16 bytes
        whole_blocks = row["kv_cache_bytes"] // per_token // cap["block_size"]
        assert cap["num_blocks"] == whole_blocks, (row["model"], cap)
    mla = next(r for r in rows if r["model"] == "mla")
    assert mla["capacity"]["attention_backend"] in (
        "CPU_MLA",
        "TRITON_MLA",
        "FLASHMLA",
        "FLASHINFER_MLA",
        None,
    )


def test_quick_decode_and_batch_ran_every_request(quick_rows):
    _, rows = quick_rows
    for row in rows:
        batch = row["batch"]
        assert batch["output_tokens"] == batch["num_requests"] * batch["output_len"]
        levels = [lv["concurrency"] for lv in row["decode"]["levels_measured"]]
        assert levels and levels == sorted(levels)
        assert all(lv["steps_timed"] >= 1 for lv in row["decode"]["levels_measured"])
    assert "| vLLM: KV blocks x block size |" in bench_report.markdown(rows)
