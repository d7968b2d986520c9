"""The project's own benchmarks and experiments, not installed with hf-attn: run them from a checkout
(`python -m benchmarks.gpu`, `python -m benchmarks.scale`, ...; benchmarks/README.md). They import
`hf_attn` and its layers (`hf_attn.tooling`, `hf_attn.conversion`, `hf_attn.eval`); nothing installed imports
them."""
