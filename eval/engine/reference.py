"""The references an engine is checked against, computed here with transformers (fp32): the export read by
vanilla `DeepseekV3ForCausalLM`, and the `llama_mla` checkpoint it was exported from (hf_attn's model).

For each prompt (token ids): the greedy continuation of `new_tokens` tokens, the log-prob of every prompt
token after the first, and the full log-softmax at each generated step (for the decode log-probs and for the
margin of a greedy divergence). Prompts run one at a time, unpadded: nothing but the model differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_attn  # noqa: F401  (registers llama_mla)


@dataclass(frozen=True)
class Reference:
    """One model's outputs on the check's prompts (lists indexed by prompt)."""

    tokens: tuple[tuple[int, ...], ...]  # greedy continuation, new_tokens each
    prompt_logprobs: tuple[torch.Tensor, ...]  # (n - 1,) log p(prompt[i] | prompt[:i]), i = 1 .. n - 1
    step_logprobs: tuple[torch.Tensor, ...]  # (new_tokens, V) log-softmax at each generated position


@torch.inference_mode()
def _greedy(model, ids: list[int], new_tokens: int) -> tuple[int, ...]:
    prompt = torch.tensor([ids])  # (1, n)
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )  # (1, n + new_tokens)
    return tuple(out[0, len(ids) :].tolist())


@torch.inference_mode()
def _scored(model, ids: list[int], continuation: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt log-probs (n - 1,), log-softmax at each continuation step (k, V)) in one forward."""
    seq = torch.tensor([list(ids) + list(continuation)])  # (1, n + k)
    logprobs = torch.log_softmax(model(input_ids=seq).logits[0].float(), dim=-1)  # (n + k, V)
    n = len(ids)
    prompt_lp = logprobs[: n - 1].gather(1, seq[0, 1:n, None])[:, 0]  # (n - 1,)
    return prompt_lp, logprobs[n - 1 : n - 1 + len(continuation)]


def run_model(
    model,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    continuations: tuple[tuple[int, ...], ...] | None = None,
) -> Reference:
    """Greedy continuations and log-probs of `model` (in eval mode) on every prompt; with `continuations`,
    those tokens are scored instead of generated (teacher forcing: one forward per prompt)."""
    tokens = continuations or tuple(_greedy(model, ids, new_tokens) for ids in prompts)
    scored = [_scored(model, ids, cont) for ids, cont in zip(prompts, tokens)]
    return Reference(
        tokens=tuple(tokens),
        prompt_logprobs=tuple(p for p, _ in scored),
        step_logprobs=tuple(s for _, s in scored),
    )


def load(path: Path):
    """A checkpoint in fp32, eager attention, eval mode (llama_mla via hf_attn's registration)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def set_latent_norm_eps(model, eps: float) -> None:
    """Every DeepSeek layer's kv_a_layernorm eps (what vLLM and SGLang use: rms_norm_eps)."""
    for layer in model.model.layers:
        layer.self_attn.kv_a_layernorm.variance_epsilon = eps


def common_steps(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Generated steps whose distributions two runs computed on the same prefix: up to and including the
    first differing token."""
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j + 1
    return min(len(a), len(b))


def max_logprob_gap(a: Reference, b: Reference) -> float:
    """max |a - b| over every prompt log-prob and every generated step's full log-softmax on a common
    prefix."""
    gaps = [(x - y).abs().max().item() for x, y in zip(a.prompt_logprobs, b.prompt_logprobs) if x.numel()]
    for ta, tb, x, y in zip(a.tokens, b.tokens, a.step_logprobs, b.step_logprobs):
        n = common_steps(ta, tb)
        gaps.append((x[:n] - y[:n]).abs().max().item())
    return max(gaps, default=0.0)
