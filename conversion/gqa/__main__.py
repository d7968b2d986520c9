"""`python -m conversion.gqa`: `hf-attn convert gqa`."""

import sys

from hf_attn.conversion.cli import gqa_main

if __name__ == "__main__":
    sys.exit(gqa_main())
