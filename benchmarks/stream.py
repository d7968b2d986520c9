"""Peak memory of the streamed mean-pooling conversion, against the largest tensor and the whole model.

    python -m benchmarks.stream [--model SRC] [--num-kv-heads 1] [--shard-mb 32] [--output results.json]

1. Re-save the source in small safetensors shards (`--shard-mb`, default 32 MiB, with an index) using the
   streaming writer, so the benchmark also covers sharded reading and writing.
2. In a fresh child process, import everything, reset the kernel's resident high-water mark (Linux:
   `/proc/self/clear_refs`, then `VmHWM`), run `conversion.gqa.convert_gqa(method="mean")` on the sharded
   copy into sharded output, and read the high-water mark. Peak minus the RSS after imports is what the
   conversion itself needed (reads use plain file I/O, no mmap, so every byte read is counted).
3. For contrast, a second child loads the whole sharded state dict the usual way (safetensors `load_file`
   of every shard) and reports the same difference.
Prints one JSON object: tensor and model sizes, and the two peaks above the post-import baseline (MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.errors import check_number
from hf_attn.tooling.files import check_output, write_json

PROG = "python -m benchmarks.stream"
WRITER = "hf-attn benchmarks.stream"  # its JSON's written_by: an hf-attn output (the output guard)

_PEAK = r"""
from pathlib import Path

from hf_attn.eval.bench.memory import reset_peak_rss, status_bytes


def reset_peak():
    # reset the kernel's resident high-water mark (VmHWM) to the current RSS; return the RSS in KiB
    if not reset_peak_rss():
        raise OSError("cannot reset the peak RSS through /proc/self/clear_refs (Linux only)")
    return status_bytes("VmRSS") // 1024


def peak_kib():
    return status_bytes("VmHWM") // 1024
"""

_CHILD_CONVERT = (
    _PEAK
    + r"""
import json, sys
from hf_attn.conversion.gqa import GQASpec, WriteSpec, convert_gqa
base = reset_peak()
spec = GQASpec(num_kv_heads=int(sys.argv[3]), method="mean")
convert_gqa(spec, src=sys.argv[1], dst=sys.argv[2], write=WriteSpec(max_shard_bytes=int(sys.argv[4])))
print(json.dumps({"baseline_kib": base, "peak_kib": peak_kib()}))
"""
)

_CHILD_LOAD_ALL = (
    _PEAK
    + r"""
import json, sys
from safetensors.torch import load_file
import hf_attn.conversion.gqa  # same imports as the conversion child

base = reset_peak()
state = {}
for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    state.update({k: v.clone() for k, v in load_file(f).items()})
print(json.dumps({"baseline_kib": base, "peak_kib": peak_kib()}))
"""
)


def _child(code: str, *args: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(*, model: str | None, num_kv_heads: int, shard_mb: int, workdir: Path) -> dict:
    from hf_attn.conversion.checkpoint.io import (
        copy_side_files,
        iter_tensors,
        read_config,
        tensor_index,
        write_config,
    )
    from hf_attn.conversion.checkpoint.shards import ShardedWriter
    from hf_attn.tooling.loading import resolve_model

    src = resolve_model(model)
    shard_bytes = shard_mb * 1024 * 1024
    sharded = workdir / "sharded-source"
    sharded.mkdir()
    with ShardedWriter(sharded, max_shard_bytes=shard_bytes) as writer:
        for name, tensor in iter_tensors(src):
            writer.add(name, tensor)
    write_config(sharded, read_config(src))
    copy_side_files(src, sharded)
    index = tensor_index(sharded)
    sizes = {name: (info.end - info.begin) for name, info in index.items()}
    largest = max(sizes, key=sizes.get)
    mib = 1024 * 1024

    conv = _child(
        _CHILD_CONVERT, str(sharded), str(workdir / "converted"), str(num_kv_heads), str(shard_bytes)
    )
    load = _child(_CHILD_LOAD_ALL, str(sharded))
    out_files = sorted((workdir / "converted").glob("*.safetensors"))
    return {
        "model": str(src),
        "num_kv_heads": num_kv_heads,
        "shard_mib": shard_mb,
        "source_shards": len({i.file for i in index.values()}),
        "output_shards": len(out_files),
        "tensors": len(index),
        "model_mib": round(sum(sizes.values()) / mib, 1),
        "largest_tensor": largest,
        "largest_tensor_mib": round(sizes[largest] / mib, 1),
        "streamed_conversion_peak_above_baseline_mib": round(
            (conv["peak_kib"] - conv["baseline_kib"]) / 1024, 1
        ),
        "load_whole_state_dict_peak_above_baseline_mib": round(
            (load["peak_kib"] - load["baseline_kib"]) / 1024, 1
        ),
        "baseline_rss_mib": round(conv["baseline_kib"] / 1024, 1),
        "note": "peak RSS (VmHWM, reset after imports) of a fresh process minus its RSS after imports",
    }


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir or hub id (default: embedded SmolLM2)")
    parser.add_argument("--num-kv-heads", type=int, default=1, help="KV heads after pooling (default 1)")
    parser.add_argument(
        "--shard-mb", type=int, default=32, help="shard size of the re-saved source and output (default 32)"
    )
    parser.add_argument("--output", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)

    def bench() -> None:
        check_number("--num-kv-heads", args.num_kv_heads, minimum=1, inclusive=True, integer=True)
        check_number("--shard-mb", args.shard_mb, minimum=1, inclusive=True, integer=True)
        if args.output:
            check_output(None, args.output, overwrite=True, kind="json")
        with tempfile.TemporaryDirectory(prefix="hf-attn-bench-stream-") as tmp:
            result = run(
                model=args.model, num_kv_heads=args.num_kv_heads, shard_mb=args.shard_mb, workdir=Path(tmp)
            )
        print(json.dumps(result, indent=2))
        if args.output:
            write_json(args.output, result, prog=WRITER)

    return run_command(PROG, bench)


if __name__ == "__main__":
    sys.exit(main())
