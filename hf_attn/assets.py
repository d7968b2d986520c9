"""`python -m hf_attn.assets`: fetch the embedded default (an alias of `hf_attn.tooling.assets`)."""

from hf_attn.tooling.assets import *  # noqa: F403
from hf_attn.tooling.assets import main

if __name__ == "__main__":
    raise SystemExit(main())
