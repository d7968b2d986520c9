"""`python -m eval.bench_mla_decode`: an alias of `hf-attn bench mla-decode`."""

from hf_attn.eval.bench.mla_decode import main

if __name__ == "__main__":
    raise SystemExit(main())
