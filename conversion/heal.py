"""An alias of `hf_attn.conversion.training.heal`: importing it warns once with that name and gives that
module; `python -m conversion.heal` runs `hf-attn heal`."""

import sys
import warnings

from hf_attn.conversion.training import heal

if __name__ == "__main__":
    sys.exit(heal.main())
warnings.warn(
    "hf_attn.conversion.heal is now hf_attn.conversion.training.heal", DeprecationWarning, stacklevel=2
)
sys.modules[__name__] = heal
