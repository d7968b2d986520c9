"""`python -m conversion.training`: `hf-attn heal`."""

import sys

from hf_attn.conversion.training.heal import main

if __name__ == "__main__":
    sys.exit(main())
