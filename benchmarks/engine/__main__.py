"""`python -m benchmarks.engine`: the engine benchmark (bench.py)."""

from benchmarks.engine.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
