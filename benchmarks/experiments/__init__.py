"""Research experiments on hf-attn's converters, not part of the installed package. Run them from the
checkout, e.g. `python -m benchmarks.experiments.mla_curve --grid quick`; each uses the shared runner
(`benchmarks/experiments/runner.py`)."""
