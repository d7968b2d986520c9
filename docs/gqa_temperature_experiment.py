"""Per-query-head temperature correction of a pooled checkpoint: alpha scaling q rows (scores) chosen to
minimise KL(p_source || p_pooled) on calibration text, each layer on the source's own inputs."""
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import rotate_half
from hf_attn.conversion import calibration as cal

torch.set_num_threads(1)
src, pooled, dst = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 2048
mode = sys.argv[5] if len(sys.argv) > 5 else "head"
tok = AutoTokenizer.from_pretrained(src)
ids = cal.calibration_ids(tok, None, tokens)
ms = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
mp = AutoModelForCausalLM.from_pretrained(pooled, dtype=torch.float32).eval()
alphas_grid = torch.linspace(0.6, 1.8, 25)
stats = {}  # layer -> (len(grid), Hq) summed KL

def rot(x, cos, sin):
    return x * cos + rotate_half(x) * sin

def scores(att, x, cos, sin):
    t = x.shape[0]; d = att.head_dim
    q = att.q_proj(x).view(t, -1, d).transpose(0, 1)
    k = att.k_proj(x).view(t, -1, d).transpose(0, 1)
    q, k = rot(q, cos, sin), rot(k, cos, sin)
    k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    return (q @ k.transpose(1, 2)) * att.scaling  # (Hq, T, T)

def fn(idx, x, pe):
    x = x[0].float(); cos, sin = pe[0][0], pe[1][0]
    t = x.shape[0]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    s0 = scores(ms.model.layers[idx].self_attn, x, cos, sin).masked_fill(future, -1e30)
    s1 = scores(mp.model.layers[idx].self_attn, x, cos, sin).masked_fill(future, -1e30)
    lp0 = s0.log_softmax(-1); p0 = lp0.exp()
    out = []
    for a in alphas_grid:
        lp1 = (s1 * a).log_softmax(-1)
        out.append((p0 * (lp0 - lp1)).sum(-1).sum(-1))  # (Hq,)
    kl = torch.stack(out)
    stats[idx] = stats.get(idx, 0) + kl

cal.for_each_attention_input(ms, ids, fn, window=1024, progress=False)
shutil.copytree(pooled, dst)
cfg = json.loads((pooled / "config.json").read_text())
hq, d = cfg["num_attention_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
chosen = {}
for l, kl in stats.items():
    if mode == "layer":
        i = kl.sum(1).argmin().item(); a = torch.full((hq,), alphas_grid[i].item())
    else:
        a = alphas_grid[kl.argmin(0)]
    chosen[l] = a
    print(l, "KL@1", round(kl[10].sum().item() / tokens, 4), "best", round(kl.min(0).values.sum().item() / tokens, 4), [round(v, 2) for v in a.tolist()])
for f in dst.glob("*.safetensors"):
    t = load_file(f)
    for l, a in chosen.items():
        for kind in ("weight", "bias"):
            n = f"model.layers.{l}.self_attn.q_proj.{kind}"
            if n in t:
                scale = a.repeat_interleave(d).to(t[n].dtype)
                t[n] = (t[n] * (scale[:, None] if kind == "weight" else scale)).contiguous()
    save_file(t, f, metadata={"format": "pt"})
