"""`python -m conversion.gqa`: `hf-attn convert gqa`."""

from hf_attn.conversion.cli import gqa_main

if __name__ == "__main__":
    raise SystemExit(gqa_main())
