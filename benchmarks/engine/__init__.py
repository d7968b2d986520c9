"""The KV-cache payoff of an MLA export inside vLLM (`python -m benchmarks.engine`, bench.py): the runner,
its worker in the engine's environment (bench_worker.py) and its tables (bench_report.py)."""
