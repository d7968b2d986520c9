"""`python -m conversion.export`: `hf-attn export`."""

from hf_attn.conversion.export.deepseek import main

if __name__ == "__main__":
    raise SystemExit(main())
