"""The MLA kernel GPU benchmark's CLI layer and table on CPU (the measurements themselves need a GPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import mla_kernel


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the benchmark would run")
def test_refuses_without_cuda(capsys):
    assert mla_kernel.main(["--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CUDA" in err


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--rope-pairs", "33"], ["--repeats", "0"]])
def test_bad_values_exit_2(capsys, argv):
    assert mla_kernel.main(argv) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_quick_grid_and_explicit_options_win():
    parser = mla_kernel.build_parser()
    parser.set_defaults(**mla_kernel.QUICK)
    args = parser.parse_args(["--quick", "--batch", "32"])
    assert args.batch == [32] and args.context == mla_kernel.QUICK["context"]


def test_table_ratios_and_targets():
    def row(context, kernel_ms, layer_triton_ms, layer_torch_ms, layout="per-head"):
        return dict(
            shape="llama3-8b", kv_lora_rank=512, rope_width=48, rope_heads=8 if layout == "per-head" else 1,
            batch=1, context=context, kernel_ms=kernel_ms, kernel_gbps=1000.0 / kernel_ms,
            layer_triton_ms=layer_triton_ms, layer_torch_ms=layer_torch_ms, sdpa_ms=0.2,
            hf_attn_grouped_ms=0.1,
        )  # fmt: skip

    record = {
        "copy_gbps": 2000.0,
        "rows": [
            row(1024, 1.0, 0.5, 0.6),  # 50% of copy below 8k: no bandwidth target; speedup 1.2x: missed
            row(8192, 0.5, 0.25, 1.0),  # 100% of copy, 4x: met
            row(8192, 1.0, None, None, layout="shared"),  # 50% of copy from 8k: missed; no layer timing
        ],
    }
    rows = mla_kernel.summarize(record)
    assert [r["targets_met"] for r in rows] == [False, True, False]
    assert rows[1]["copy_fraction"] == pytest.approx(1.0) and rows[1]["layer_speedup"] == pytest.approx(4.0)
    assert rows[0]["grouped_vs_sdpa"] == pytest.approx(2.0)
    table = mla_kernel.format_table(record).splitlines()
    assert len(table) == 2 + 3 and "n/a" in table[-1] and "not met" in table[-1] and "| met |" in table[3]
