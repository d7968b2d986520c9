"""Where on the Python FAQ a conversion loses: code lines against prose (docs/research/cross-domain.md).

    python -m benchmarks.experiments.cross_domain_token_loss MODEL [MODEL ...]

The cross-domain protocol's scored tokens (the FAQ's first 8,192, disjoint 1,024-token windows, fp32), each
token's NLL under the embedded SmolLM2 and under MODEL; a token counts as code when its line starts with
three spaces (the FAQ's literal blocks). Prints the share of code tokens, the mean NLL increase per token on
code and on prose, and the code tokens' share of the total increase.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_attn  # noqa: F401  (registers llama_mla)
from hf_attn.tooling import assets

TOKENS, WINDOW = 8192, 1024

source = assets.smollm2_dir()
tokenizer = AutoTokenizer.from_pretrained(source)
text = assets.python_docs_eval_file().read_text(encoding="utf-8")
encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
ids = torch.tensor(encoded["input_ids"][:TOKENS]).view(-1, WINDOW)  # (windows, WINDOW)
starts = [text.rfind("\n", 0, begin) + 1 for begin, _ in encoded["offset_mapping"][:TOKENS]]
code = torch.tensor([text[s : s + 3] == "   " for s in starts]).view(-1, WINDOW)[:, 1:]  # scored tokens


def token_nll(path) -> torch.Tensor:
    """(windows, WINDOW - 1) NLL of every scored token."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = torch.stack([model(w[None]).logits[0, :-1] for w in ids])  # (windows, WINDOW - 1, vocab)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


base = token_nll(source)
share = code.float().mean()
print(f"code tokens {share:.3f}; source NLL code {base[code].mean():.3f}, prose {base[~code].mean():.3f}")
for path in sys.argv[1:]:
    rise = token_nll(path) - base
    print(
        f"{path}: NLL rise per token code {rise[code].mean():.3f}, prose {rise[~code].mean():.3f}; "
        f"code's share of the total rise {rise[code].sum() / rise.sum():.3f}"
    )
