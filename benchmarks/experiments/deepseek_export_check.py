"""Measure the deepseek_v3 export's exactness on real text: source llama_mla vs vanilla transformers.

    python -m benchmarks.experiments.deepseek_export_check [--source MLA_DIR] [--tokens 512] [--new-tokens 32]
        [--engine-dims native|576|512|320]

The source (a llama_mla checkpoint in the DeepSeek layout; default: a SmolLM2-shaped demo built from
SmolLM2's weights, see `demo_source`) runs here in fp32; its export is loaded by
`AutoModelForCausalLM.from_pretrained` in a fresh interpreter where importing hf_attn is blocked. Reported:
max |logit difference| / max |logit| over the first --tokens tokens of Persuasion, and whether the
--new-tokens greedy continuation of its first 64 tokens is identical. Temporary checkpoints are deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

CHILD = textwrap.dedent(
    """
    import importlib.abc, json, os, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_attn" or name.startswith("hf_attn."):
                raise ImportError(f"blocked: {name}")
    sys.meta_path.insert(0, Block())
    sys.path = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "hf_attn"))]
    import torch
    from transformers import AutoModelForCausalLM
    path, expected = sys.argv[1], sys.argv[2]
    data = torch.load(expected)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=data["ids"]).logits
        gen = model.generate(input_ids=data["prompt"], do_sample=False, max_new_tokens=data["new_tokens"])
    print(json.dumps({
        "class": type(model).__name__,
        "max_abs_diff": (logits - data["logits"]).abs().max().item(),
        "max_abs_logit": data["logits"].abs().max().item(),
        "generate_equal": bool(torch.equal(gen, data["generated"])),
        "hf_attn_loaded": any(m == "hf_attn" or m.startswith("hf_attn.") for m in sys.modules),
    }))
    """
)


@torch.inference_mode()
def demo_source(*, smollm2_dir: Path, dst: Path, rope_pairs: int = 16) -> Path:
    """A llama_mla checkpoint in the DeepSeek layout with SmolLM2's shapes and weights (not an accurate
    conversion of SmolLM2: the shared RoPE key is KV head 0's key on pairs 0..r-1, the latent is the full-rank
    stack of the other keys' and the values' rows, the latent norm's gain is 1). It exercises the export on
    real-size, real-weight tensors; the DeepSeek-layout converter makes the accurate ones."""
    from transformers import AutoModelForCausalLM

    from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM

    src = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    sc = src.config
    Hq, Hkv, d, r = sc.num_attention_heads, sc.num_key_value_heads, sc.head_dim, rope_pairs
    half, dn = d // 2, d - 2 * rope_pairs
    fields = {k: v for k, v in sc.to_dict().items() if k not in ("model_type", "architectures", "auto_map")}
    cfg = LlamaMLAConfig(
        **fields,
        kv_lora_rank=Hkv * dn + Hkv * d,
        rope_pairs=r,
        rope_layout="shared",
        latent_norm=True,
        source_model_type="llama",
    )
    model = LlamaMLAForCausalLM(cfg).eval()
    rope = list(range(r)) + [p + half for p in range(r)]  # head-local rope rows (rotate-half pairs)
    nope = [i for i in range(half) if i >= r] + [i + half for i in range(half) if i >= r]
    sd = src.state_dict()
    new = {k: v for k, v in sd.items() if ".self_attn." not in k}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}.self_attn."
        q, k, v = (sd[pre + f"{n}_proj.weight"] for n in "qkv")
        new[pre + "q_proj.weight"] = torch.cat([q[h * d + torch.tensor(rope + nope)] for h in range(Hq)])
        new[pre + "k_rope_proj.weight"] = k[torch.tensor(rope)]  # KV head 0's key on the kept pairs
        k_nope = torch.cat([k[g * d + torch.tensor(nope)] for g in range(Hkv)])  # (Hkv dn, E)
        new[pre + "kv_down_proj.weight"] = torch.cat([k_nope, v])  # (d_c, E)
        eye = torch.eye(cfg.kv_lora_rank)
        new[pre + "k_up_proj.weight"], new[pre + "v_up_proj.weight"] = eye[: Hkv * dn], eye[Hkv * dn :]
        new[pre + "latent_norm.weight"] = torch.ones(cfg.kv_lora_rank)
        new[pre + "o_proj.weight"] = sd[pre + "o_proj.weight"]
    missing, unexpected = model.load_state_dict(new, strict=False)
    assert not unexpected and all(k.endswith("rope_dims") or k == "lm_head.weight" for k in missing), missing
    model.tie_weights()
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy2(smollm2_dir / name, dst / name)
    return dst


@torch.inference_mode()
def check_export(
    *, source: Path, exported: Path, text: str, tokens: int, new_tokens: int, workdir: Path
) -> dict:
    """Source logits / greedy continuation here, the export's in an hf_attn-free child; the comparison."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_attn  # noqa: F401  (registers llama_mla)

    tok = AutoTokenizer.from_pretrained(source)
    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]  # (1, tokens)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    prompt = ids[:, :64]
    expected = {
        "ids": ids,
        "logits": model(input_ids=ids).logits,
        "prompt": prompt,
        "new_tokens": new_tokens,
        "generated": model.generate(input_ids=prompt, do_sample=False, max_new_tokens=new_tokens),
    }
    torch.save(expected, workdir / "expected.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(exported), str(workdir / "expected.pt")],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["relative"] = res["max_abs_diff"] / res["max_abs_logit"]
    res["tokens"] = int(ids.shape[1])
    return res


def main(argv: list[str] | None = None) -> int:
    from hf_attn.conversion.export.deepseek import export_checkpoint
    from hf_attn.conversion.specs import ENGINE_DIMS
    from hf_attn.tooling import assets

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.experiments.deepseek_export_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--source", default=None, help="llama_mla DeepSeek-layout dir (default: SmolLM2 demo)"
    )
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--engine-dims", choices=ENGINE_DIMS, default="native", help="as hf-attn export's")
    args = parser.parse_args(argv)
    text = assets.austen_file(assets.EVAL_NOVEL).read_text()
    with tempfile.TemporaryDirectory(prefix="deepseek-export-check-") as tmp:
        work = Path(tmp)
        source = (
            Path(args.source)
            if args.source
            else demo_source(smollm2_dir=assets.smollm2_dir(), dst=work / "src")
        )
        exported = export_checkpoint(src=source, dst=work / "out", engine_dims=args.engine_dims)
        res = check_export(
            source=source,
            exported=exported,
            text=text,
            tokens=args.tokens,
            new_tokens=args.new_tokens,
            workdir=work,
        )
    print(json.dumps({"source": args.source or "smollm2-demo", "engine_dims": args.engine_dims, **res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
