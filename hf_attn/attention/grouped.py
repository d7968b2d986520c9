"""Grouped attention (MHA / GQA / MQA) that never materialises repeated K/V. PLACEHOLDER: to be completed."""

from __future__ import annotations

import torch


def grouped_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    B, Hq, T, D = query.shape
    Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    scaling = D**-0.5 if scaling is None else scaling
    q = query.view(B, Hkv, G, T, D)  # (B, Hkv, G, T, D)
    scores = torch.matmul(q, key.unsqueeze(2).transpose(-1, -2)).float() * scaling  # (B, Hkv, G, T, S)
    if attention_mask is None:
        if getattr(module, "is_causal", True) and T > 1:
            keep = torch.ones(T, S, dtype=torch.bool, device=query.device).tril(S - T)
            scores = scores.masked_fill(~keep, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask.unsqueeze(2), float("-inf"))
    else:
        scores = scores + attention_mask.unsqueeze(2)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(value.dtype)
    out = torch.matmul(probs, value.unsqueeze(2))  # (B, Hkv, G, T, Dv)
    return out.view(B, Hq, T, Dv).transpose(1, 2).contiguous(), None
