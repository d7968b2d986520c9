"""`python -m conversion.export`: `hf-attn export`."""

import sys

from hf_attn.conversion.export.deepseek import main

if __name__ == "__main__":
    sys.exit(main())
