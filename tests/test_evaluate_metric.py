"""The `evaluate` metric eval/metrics/corpus_perplexity: loaded through `evaluate.load(<dir>)` offline, equal
to `eval.perplexity` and to an independent per-window loss computation."""

import math
from pathlib import Path

import pytest
import torch
from conftest import saved_checkpoint

evaluate = pytest.importorskip("evaluate")

from hf_attn.eval import perplexity  # noqa: E402

METRIC_DIR = Path(__file__).resolve().parents[1] / "eval" / "metrics" / "corpus_perplexity"


@pytest.fixture(scope="module")
def tiny_checkpoint(smollm2_path, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer, saved as a checkpoint directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    yield from saved_checkpoint(tmp_path_factory, "tiny-llama", LlamaForCausalLM(config), tokenizer)


@pytest.fixture(scope="module")
def texts(persuasion_path, tmp_path_factory):
    """Two short texts from *Persuasion*, also as files (what `eval.perplexity --text` reads)."""
    novel = persuasion_path.read_text(encoding="utf-8")
    parts = [novel[2000:4500], novel[40000:42000]]
    root = tmp_path_factory.mktemp("texts")
    files = []
    for i, part in enumerate(parts):
        files.append(root / f"part{i}.txt")
        files[-1].write_text(part, encoding="utf-8")
    return parts, files


@pytest.fixture(scope="module")
def metric(monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("HF_EVALUATE_OFFLINE", "1")
    return evaluate.load(str(METRIC_DIR))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize(
    "options",
    [
        dict(context_length=64, stride=64, batch_size=1),
        dict(context_length=64, stride=24, batch_size=3, max_tokens=500),
    ],
    ids=["disjoint", "sliding-batched"],
)
def test_metric_equals_eval_perplexity(metric, tiny_checkpoint, texts, options):
    parts, files = texts
    got = metric.compute(predictions=parts, model_id=str(tiny_checkpoint), **options)
    settings = perplexity.PerplexitySettings(
        model=str(tiny_checkpoint), texts=files, progress=False, **options
    )
    ref = perplexity.run(settings)
    assert got["corpus_sha256"] == ref["corpus_sha256"]  # the same corpus text ...
    assert got["tokens_scored"] == ref["tokens_scored"]  # ... the same windows ...
    assert got["windows"] == ref["windows"]
    assert abs(got["perplexity"] - ref["perplexity"]) <= 1e-6 * ref["perplexity"]  # ... the same numbers
    assert abs(got["nll_sum"] - ref["nll_sum"]) <= 1e-6 * abs(ref["nll_sum"])


def test_metric_matches_independent_window_losses(metric, tiny_checkpoint, texts):
    """Disjoint windows: perplexity = exp(weighted mean of the model's own per-window loss)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parts, _ = texts
    length = 64
    got = metric.compute(predictions=parts, model_id=str(tiny_checkpoint), context_length=length)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="eager").eval()
    ids = tokenizer("\n\n".join(parts), add_special_tokens=False, return_tensors="pt").input_ids[0]
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin in range(0, ids.numel() - 1, length):
            window = ids[begin : begin + length][None]
            if window.shape[1] < 2:
                break
            loss = model(input_ids=window, labels=window).loss.item()  # mean over window length - 1 tokens
            nll, count = nll + loss * (window.shape[1] - 1), count + window.shape[1] - 1
    assert got["tokens_scored"] == count
    assert got["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_metric_card_and_features(metric):
    assert "predictions" in metric.features
    assert "sliding" in metric.description.lower()
    card = (METRIC_DIR / "README.md").read_text()
    for section in ("## Metric Description", "## How to Use", "### Inputs", "### Output Values"):
        assert section in card
