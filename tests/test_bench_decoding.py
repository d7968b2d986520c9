"""The shared decode protocol of the benchmarks and the experiment runners' row store."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_attn.eval.bench import decoding
from hf_attn.eval.bench.memory import PeakMemory
from hf_attn.eval.rows import RowStore, row_key


def tiny_llama():
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def test_chunked_prefill_and_timed_steps_are_greedy_generation():
    """Prefill in chunks + warmup + timed steps produce exactly `generate`'s greedy tokens."""
    model = tiny_llama()
    prompt = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))  # (B, P)
    cache, logits = decoding.prefill(model, prompt, chunk=4)
    first = logits.argmax(-1, keepdim=True)  # (B, 1)
    timing = decoding.time_decode(model, cache, first, steps=5, warmup=2)
    reference = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[:, 11:]  # (B, 8)
    assert torch.equal(torch.cat([first, timing.generated], dim=1), reference)
    assert len(timing.step_seconds) == 5
    assert timing.tokens_per_second == 2 / sorted(timing.step_seconds)[2]


def test_peak_memory_reports_a_method_and_a_peak():
    with PeakMemory(torch.device("cpu")) as memory:
        block = torch.ones(1 << 20)
    assert memory.peak >= (memory.before or 0) and memory.method and block.numel()


def test_row_store_returns_only_a_finished_row_under_its_key(tmp_path):
    store = RowStore(tmp_path / "rows")
    key = row_key({"tokens": 64}, "code")
    assert key == row_key({"tokens": 64}, "code") != row_key({"tokens": 65}, "code")
    store.put("mha", key, {"perplexity": 9.5})
    assert store.get("mha", key)["perplexity"] == 9.5
    assert store.get("mha", row_key("other")) is None  # changed settings: re-measure
    assert RowStore(tmp_path / "rows", fresh=True).get("mha", key) is None
    store.put("gqa", key, {"error": "boom"})
    assert store.get("gqa", key) is None  # a failed row is measured again
