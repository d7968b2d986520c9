"""`evaluate` metric: corpus-level sliding-window perplexity, the protocol of `eval.perplexity`.

Load it from its directory (offline too): `evaluate.load("eval/metrics/corpus_perplexity")`. The window
planning, batching and NLL summation are `hf_attn.tooling.perplexity`'s (`evaluate_perplexity`), the corpus is
joined and tokenized as `hf_attn.tooling.corpus` does for several text files, and the model is loaded by
`hf_attn.tooling.loading` (after `import hf_attn`, so `llama_mla` checkpoints and the `hf_attn_*` attention
implementations work): the result equals `python -m eval.perplexity --text FILE...` with the same options.
"""

from __future__ import annotations

import datasets
import evaluate

from hf_attn.tooling import loading
from hf_attn.tooling.corpus import SEPARATOR, Corpus, tokenize
from hf_attn.tooling.perplexity import check_window, evaluate_perplexity

_CITATION = """\
@misc{hf-attn-corpus-perplexity,
  title = {hf-attn: corpus-level sliding-window perplexity},
  note  = {The protocol of the Hugging Face Transformers perplexity guide, disjoint windows by default as in
           GPTQ / SparseGPT / TransMLA}
}
"""

_DESCRIPTION = """\
Corpus-level perplexity of a causal language model with sliding windows. The texts are joined with blank
lines into one corpus and tokenized once (no special tokens) into N tokens. Window w covers tokens
[w*stride, w*stride + context_length); each window scores only the tokens no earlier window scored, so with
stride == context_length (the default: disjoint windows) the first token of every window is context only.
Perplexity = exp(sum of token NLL / number of scored tokens), the NLL summed in float64. This is one number
for the whole corpus (not a mean of per-text perplexities, which is what evaluate's `perplexity` metric
returns).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): the texts, joined with blank lines ("\\n\\n") in order into one corpus.
    model_id (str): a checkpoint directory or hub id of a causal LM (default: hf-attn's embedded
        SmolLM2-135M-Instruct). hf-attn checkpoints (grouped attention, `llama_mla`) load too.
    context_length (int): window length in tokens (default 1024).
    stride (int): window advance, 0 < stride <= context_length (default: context_length, disjoint windows).
    batch_size (int): windows of equal shape per forward pass (default 1; does not change the result beyond
        floating-point noise).
    dtype (str): "float32" (default), "bfloat16" or "float16".
    max_tokens (int): evaluate only the first max_tokens tokens of the corpus (default: all).
    attn_implementation (str): e.g. "eager", "sdpa", "hf_attn_grouped" (default: transformers' choice).
    device (str): e.g. "cpu", "cuda" (default: where the model loads).
Returns:
    perplexity (float): exp(nll_sum / tokens_scored).
    nll_sum (float): summed negative log-likelihood of the scored tokens, in nats.
    tokens_scored (int): number of scored tokens.
    corpus_tokens (int): tokens in the joined corpus (before max_tokens).
    windows (int): number of windows.
    context_length (int), stride (int): the windows used.
    corpus_sha256 (str): sha256 of the joined corpus text (UTF-8).
Examples:
    >>> metric = evaluate.load("eval/metrics/corpus_perplexity")
    >>> out = metric.compute(predictions=[open("persuasion.txt").read()], model_id="path/to/model",
    ...                      context_length=1024, max_tokens=8192)
    >>> sorted(out)  # doctest: +NORMALIZE_WHITESPACE
    ['context_length', 'corpus_sha256', 'corpus_tokens', 'nll_sum', 'perplexity', 'stride', 'tokens_scored',
     'windows']
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class CorpusPerplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(
        self,
        predictions,
        model_id: str | None = None,
        context_length: int = 1024,
        stride: int | None = None,
        batch_size: int = 1,
        dtype: str = "float32",
        max_tokens: int | None = None,
        attn_implementation: str | None = None,
        device: str | None = None,
    ):
        stride = check_window(context_length, stride)
        corpus = Corpus.from_text(SEPARATOR.join(predictions), "predictions")
        model_path = str(loading.resolve_model(model_id))
        tokenizer = loading.load_tokenizer(model_path)
        input_ids = tokenize(tokenizer, corpus)
        lm = loading.load_causal_lm(
            model_path, attn_implementation=attn_implementation, dtype=loading.parse_dtype(dtype)
        )
        if device is not None:
            lm.to(device)
        result = evaluate_perplexity(
            lm,
            input_ids,
            context_length=context_length,
            stride=stride,
            batch_size=batch_size,
            max_tokens=max_tokens,
            progress=False,
        )
        return {
            **{key: getattr(result, key) for key in ("perplexity", "nll_sum", "tokens_scored")},
            "corpus_tokens": int(input_ids.numel()),
            **{key: getattr(result, key) for key in ("windows", "context_length", "stride")},
            "corpus_sha256": corpus.sha256,
        }
