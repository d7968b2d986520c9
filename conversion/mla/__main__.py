"""`python -m conversion.mla`: `hf-attn convert mla`."""

from hf_attn.conversion.cli import mla_main

if __name__ == "__main__":
    raise SystemExit(mla_main())
