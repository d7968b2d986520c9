"""`python -m eval.bench_perplexity`: an alias of `hf-attn bench perplexity`."""

from hf_attn.eval.bench.perplexity import main

if __name__ == "__main__":
    raise SystemExit(main())
