"""`python -m eval.bench_decode`: an alias of `hf-attn bench decode`."""

from hf_attn.eval.bench.decode import main

if __name__ == "__main__":
    raise SystemExit(main())
