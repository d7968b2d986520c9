"""`python -m eval.bench_attention`: an alias of `hf-attn bench attention`."""

from hf_attn.eval.bench.attention import main

if __name__ == "__main__":
    raise SystemExit(main())
