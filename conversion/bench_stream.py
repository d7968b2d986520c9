"""`python -m conversion.bench_stream`: an alias of `hf-attn bench stream`."""

from hf_attn.eval.bench.stream import main

if __name__ == "__main__":
    raise SystemExit(main())
