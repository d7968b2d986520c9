"""Shared tooling of the offline layers (conversion, evaluation): dtype parsing, model and tokenizer loading
with ONE model resolver, corpora, files and hashing, the embedded assets, the perplexity protocol, and the one
command-line error path. Never imported by the runtime: `import hf_attn` loads none of it (docs/layout.md).
"""
