"""`python -m conversion.training`: `hf-attn heal`."""

from hf_attn.conversion.training.heal import main

if __name__ == "__main__":
    raise SystemExit(main())
