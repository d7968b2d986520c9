"""`python -m conversion.mla`: `hf-attn convert mla`."""

import sys

from hf_attn.conversion.cli import mla_main

if __name__ == "__main__":
    sys.exit(mla_main())
