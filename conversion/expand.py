"""An alias of `hf_attn.conversion.gqa.expand`: importing it warns once with that name and gives that
module; `python -m conversion.expand` runs `hf-attn convert expand`."""

import sys
import warnings

from hf_attn.conversion.cli import expand_main
from hf_attn.conversion.gqa import expand

if __name__ == "__main__":
    sys.exit(expand_main())
warnings.warn(
    "hf_attn.conversion.expand is now hf_attn.conversion.gqa.expand", DeprecationWarning, stacklevel=2
)
sys.modules[__name__] = expand
