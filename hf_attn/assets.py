"""Former name of `hf_attn.tooling.assets` (the embedded default): every name read from here, and
`python -m hf_attn.assets`, still works, with one DeprecationWarning naming the new place."""

import warnings

import hf_attn.tooling.assets as _assets

_NEW = "hf_attn.assets is deprecated; use hf_attn.tooling.assets (python -m hf_attn.tooling.assets)"
_warned = False


def _warn_once(stacklevel: int) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(_NEW, DeprecationWarning, stacklevel=stacklevel + 1)


def __getattr__(name: str):
    """`hf_attn.assets.NAME` -> `hf_attn.tooling.assets.NAME`, warning once (at the caller's line)."""
    if name.startswith("__"):
        raise AttributeError(name)
    value = getattr(_assets, name)  # AttributeError for a name that module does not have
    _warn_once(2)
    return value


if __name__ == "__main__":
    _warn_once(1)
    raise SystemExit(_assets.main())
