"""`python -m eval.bench_heal`: an alias of `hf-attn bench heal`."""

from hf_attn.eval.bench.heal import main

if __name__ == "__main__":
    raise SystemExit(main())
