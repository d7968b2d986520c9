"""A small end-to-end example on the embedded default: greedy generation with SmolLM2 under each
attention implementation (transformers' `eager`, `sdpa` and every registered hf-attn one)."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_attn
from hf_attn.tooling import assets

PROMPT = "It is a truth universally acknowledged, that"


def main() -> None:
    path = assets.smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    for name in ["eager", "sdpa", *hf_attn.IMPLEMENTATIONS]:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name, dtype=torch.float32)
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        seconds = time.perf_counter() - start
        text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        print(f"{name:>16} ({seconds:4.1f} s): {PROMPT}{text!r}")


if __name__ == "__main__":
    main()
