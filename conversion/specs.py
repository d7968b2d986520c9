"""What a conversion is asked to do, as typed specs: frozen dataclasses validated when built, from which the
parsers of `hf-attn convert gqa | mla | expand` are built (`add_spec_arguments`), so that the commands and
the library share every default. Every choice a conversion offers and every default it takes is defined
here (the constants below), and the converters, the refinement, the export and the checkpoint writer read
them from this module, which imports nothing else from `conversion/`. The specs: `CalibrationSpec`,
`KVBudget`, `GQASpec` / `MLASpec` / `ExpandSpec` (the closed forms), `RefineSpec` and `WriteSpec`;
`conversion.pipeline` composes their stages: closed form -> refinement -> export.

    from hf_attn.conversion.specs import GQASpec, MLASpec, RefineSpec
    GQASpec(num_kv_heads=1)                          # calibrated pooling, then 32 refinement steps
    GQASpec(num_kv_heads=1, method="mean")           # the GQA paper's mean pooling (with RefineSpec(steps=0))
    MLASpec(kv_budget=0.3, layout="deepseek")        # a DeepSeek-layout MLA at 30% of the cache
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_attn.tooling import assets, loading
from hf_attn.tooling.cli import add_settings_arguments, check_choices, setting
from hf_attn.tooling.devices import DEFAULT_DEVICE, DEVICE_HELP, DEVICES, resolve_device
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import check_text_files

# the calibration text and its forward (conversion.checkpoint.calibration, .layerwise)
DEFAULT_CALIBRATION_TOKENS = 8192
DEFAULT_WINDOW = 1024
DEFAULT_CORPUS = "mix"  # generalises best across both evaluation texts (README, "Calibration text")
FORWARD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# GQA pooling (conversion.gqa)
METHODS = ("calibrated", "mean")  # how the heads of a group pool; the first is the default
GROUPINGS = ("contiguous", "search")  # which KV heads pool together (conversion.gqa.grouping)

# MLA (conversion.mla)
DEFAULT_KV_BUDGET = 0.5  # `MLASpec` without a rank option (the knee of the measured curve)
SELECTIONS = ("high", "uniform", "2norm", "attention")  # which RoPE pairs a KV head keeps
CALIBRATED_SELECTIONS = ("2norm", "attention")
DEFAULT_ROPE_SELECTION = "attention"
FACTORIZATIONS = ("weight-svd", "activation", "attention")  # how the joint low-rank latent is fitted
CALIBRATED_FACTORIZATIONS = ("activation", "attention")
DEFAULT_FACTORIZATION = "attention"
LAYOUTS = ("per-head", "deepseek")  # a RoPE key per KV head, or one shared (DeepSeek MLA)
DEEPSEEK_SELECTIONS = ("attention", "high")  # the pair selections that give one progression for all layers
ALLOCATIONS = ("uniform", "greedy", "greedy-ranks")  # ranks per layer (conversion.mla.ranks)

# the export (conversion.export): its targets, and the sizes of d_c + qk_rope_head_dim that vLLM's MLA
# backends take (conversion/export/engine_dims.py)
EXPORT_TARGETS = ("deepseek_v3",)
ENGINE_DIMS = ("native", "576", "512", "320")

# the layer-local refinement (conversion.refine)
REFINE_STEPS = 32  # Adam steps per decoder layer
REFINE_TOKENS = 4096  # calibration tokens of the refinement
REFINE_TARGETS = ("layer", "attention")  # what a refined layer matches
RELATIVE_LR = 0.01
LOSS_STRIDE = 2  # each refinement step's loss on every 2nd position of its window (docs/scale.md)
# the refinement's matmuls: "auto" is bfloat16 where the device runs it natively (docs/scale.md: perplexity
# within 1% of float32's), else float32 (`refine_fit.resolve_step_dtype`)
STEP_DTYPE = "auto"
STEP_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# writing a checkpoint
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def resolve_forward(device: str, forward_dtype: str) -> tuple[torch.device, torch.dtype]:
    """(torch.device, torch.dtype) of the calibration forward (`--device auto`: `devices.resolve_device`);
    ValueError naming the value and the fix."""
    if device not in DEVICES:
        raise ValueError(f"Unknown --device {device!r}; choose one of {', '.join(DEVICES)}.")
    if forward_dtype not in FORWARD_DTYPES:
        raise ValueError(
            f"Unknown --forward-dtype {forward_dtype!r}; choose one of {', '.join(FORWARD_DTYPES)}."
        )
    return resolve_device(device), FORWARD_DTYPES[forward_dtype]


def default_allocation(
    *, kv_budget: float | None, given_ranks: bool, layout: str, selection: str, factorization: str
) -> str:
    """`greedy` where it applies and the user left the ranks to the budget (per-head layout, `attention`
    selection and factorization, no --rope-pairs / --kv-lora-rank); `uniform` otherwise. `greedy` is at
    least as good as `uniform` at every budget measured (docs/research/mla-allocation.md)."""
    ok = kv_budget is not None and not given_ranks and layout == "per-head"
    return "greedy" if ok and selection == "attention" and factorization == "attention" else "uniform"


def _check_int(flag: str, value, minimum: int) -> None:
    check_number(flag, value, minimum=minimum, inclusive=True, integer=True)


def check_num_kv_heads(value) -> None:
    """UserError unless --num-kv-heads is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"--num-kv-heads must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CalibrationSpec:
    """The calibration text of the calibrated converters (and of the refinement after them), and where the
    layer-by-layer calibration forward runs (`layerwise.LayerwiseModel`)."""

    text: tuple[str, ...] | None = setting(
        None,
        flag="--calibration-text",
        metavar="FILE",
        exclusive="calibration text",
        help="calibration text files, equal token shares, a file listed k times k shares (default: "
        "--calibration-corpus)",
    )
    corpus: str | None = setting(
        None,
        flag="--calibration-corpus",
        choices=assets.CORPORA,
        exclusive="calibration text",
        help="an embedded calibration corpus: austen (five novels), python-docs (five sections of the "
        f"Python 3.11 docs) or mix (equal token shares of both); never an evaluation text (default: "
        f"{DEFAULT_CORPUS})",
    )
    tokens: int = setting(DEFAULT_CALIBRATION_TOKENS, flag="--calibration-tokens", help="calibration tokens")
    window: int = setting(DEFAULT_WINDOW, flag="--calibration-window", help="tokens per calibration forward")
    device: str = setting(
        DEFAULT_DEVICE,
        help=f"device of the calibration forward and the refinement ({DEVICE_HELP})",
        choices=DEVICES,
    )
    forward_dtype: str = setting(
        "float32",
        help="dtype of the calibration forward (statistics still accumulate in float64)",
        choices=tuple(FORWARD_DTYPES),
    )

    def __post_init__(self):
        if self.text is not None:
            object.__setattr__(self, "text", tuple(str(f) for f in self.text))
        check_choices(self)
        if self.text and self.corpus is not None:
            raise UserError(
                f"give --calibration-text or --calibration-corpus {self.corpus}, not both; drop one"
            )
        _check_int("--calibration-tokens", self.tokens, 1)
        _check_int("--calibration-window", self.window, 1)
        if self.text:
            check_text_files(list(self.text), "--calibration-text")
        resolve_device(self.device)  # (UserError: --device cuda without CUDA)

    def files(self) -> list[Path]:
        """The calibration text files: `text`, else the files of the embedded `corpus` (default: the `mix`
        corpus, never an evaluation text; fetched if needed)."""
        if self.text:
            return [Path(f) for f in self.text]
        return assets.calibration_corpus_files(self.corpus or DEFAULT_CORPUS)


@dataclass(frozen=True)
class KVBudget:
    """A fraction in (0, 1] of the source's KV cache (`--kv-budget`). Per token and layer the source caches
    2 Hkv d numbers (K and V of its Hkv heads of width d, `kv_dim` = Hkv d); the budget allows
    floor(fraction * 2 Hkv d) of them (a 1e-9 slack absorbs the binary rounding of the fraction)."""

    fraction: float

    def __post_init__(self):
        f = self.fraction
        numeric = isinstance(f, (int, float)) and not isinstance(f, bool)
        if not (numeric and math.isfinite(f) and 0 < f <= 1):
            raise UserError(
                f"--kv-budget must be a fraction in (0, 1] of the source's KV cache, got {f!r}; e.g. 0.5"
            )

    @staticmethod
    def source_numbers(kv_dim: int) -> int:
        """Numbers the source caches per token and layer: 2 Hkv d."""
        return 2 * kv_dim

    def numbers(self, kv_dim: int) -> int:
        """Numbers per token and layer the budget allows for a source of `kv_dim` = Hkv d."""
        return int(self.fraction * self.source_numbers(kv_dim) + 1e-9)


@dataclass(frozen=True)
class GQASpec:
    """`hf-attn convert gqa`: pool the source's H KV heads into `num_kv_heads` groups (conversion.gqa)."""

    num_kv_heads: int = setting(required=True, help="G, the KV heads after pooling")
    method: str = setting(
        METHODS[0],
        choices=METHODS,
        help="how the heads of a group pool: calibrated (fitted on the calibration text, the best measured) "
        "or mean (the GQA paper's mean pooling, Ainslie et al. 2023)",
    )
    grouping: str = setting(
        GROUPINGS[0],
        choices=GROUPINGS,
        help="which KV heads pool together: consecutive ones, or searched per layer on the calibration text",
    )

    def __post_init__(self):
        check_choices(self)
        check_num_kv_heads(self.num_kv_heads)


@dataclass(frozen=True)
class MLASpec:
    """`hf-attn convert mla`: the ranks and fits of the MLA conversion (conversion.mla). Without a rank
    option (`kv_lora_rank`, `kv_budget`, `rope_pairs`, `engine_dims`) the budget is DEFAULT_KV_BUDGET;
    `rope_pairs` = d/2 alone is the exact conversion."""

    engine_dims: str | None = setting(
        None,
        choices=tuple(d for d in ENGINE_DIMS if d != "native"),
        exclusive="ranks",
        help="--layout deepseek: d_c = size - 64 and 32 shared RoPE pairs, so that `hf-attn export "
        "--engine-dims SIZE` needs no padding (sizes vLLM's MLA backends take: "
        "conversion/export/engine_dims.py)",
    )
    kv_lora_rank: int | None = setting(
        None, exclusive="ranks", help="d_c, width of the cached latent (default: the budget's)"
    )
    kv_budget: float | None = setting(
        None,
        exclusive="ranks",
        help=f"cache fraction of the source's, picks d_c and r (default: {DEFAULT_KV_BUDGET} when no other "
        "rank option is given)",
    )
    rope_pairs: int | None = setting(None, help="r, RoPE pairs kept per KV head (default: the budget's)")
    rope_selection: str = setting(
        DEFAULT_ROPE_SELECTION, choices=SELECTIONS, help="which RoPE pairs each KV head keeps"
    )
    factorization: str = setting(
        DEFAULT_FACTORIZATION, choices=FACTORIZATIONS, help="how the joint low-rank latent is fitted"
    )
    layout: str = setting(
        "per-head",
        choices=LAYOUTS,
        help="per-head: a RoPE key per KV head; deepseek: one shared RoPE key + latent norm (DeepSeek MLA, "
        "exportable to deepseek_v3)",
    )
    allocation: str | None = setting(
        None,
        choices=ALLOCATIONS,
        help="uniform: the same r and d_c in every layer; greedy: RoPE pairs per layer from the calibration; "
        "greedy-ranks: also the latent rank per layer (conversion.mla.ranks); the same total cache "
        "(default: greedy with --kv-budget and the attention selection / factorization, else uniform)",
    )

    def __post_init__(self):
        check_choices(self)
        if self.kv_budget is not None:
            KVBudget(self.kv_budget)
            if self.kv_lora_rank is not None:
                raise UserError("give either --kv-lora-rank or --kv-budget, not both")
        if self.engine_dims is not None and (
            self.layout != "deepseek" or (self.kv_lora_rank, self.kv_budget, self.rope_pairs) != (None,) * 3
        ):
            raise UserError(
                "--engine-dims sets d_c and r of --layout deepseek: drop --kv-lora-rank, --kv-budget "
                "and --rope-pairs, and give --layout deepseek"
            )
        if self.layout == "deepseek" and self.rope_selection not in DEEPSEEK_SELECTIONS:
            raise UserError(
                f"--rope-selection {self.rope_selection} picks pairs per KV head; --layout deepseek keeps "
                f"the same progression 0, s, 2s, ... in every layer: use --rope-selection "
                f"{' or '.join(DEEPSEEK_SELECTIONS)}"
            )
        allocation = self.allocation_method
        if allocation != "uniform" and self.layout == "deepseek":
            raise UserError(
                f"--allocation {allocation} gives layers different ranks, but the DeepSeek layout (and "
                "deepseek_v3) has one kv_lora_rank and one qk_rope_head_dim for every layer; use "
                "--allocation uniform"
            )
        if allocation != "uniform" and {self.rope_selection, self.factorization} != {"attention"}:
            raise UserError(
                f"--allocation {allocation} reads the `attention` selection's pair scores and the "
                f"`attention` factorization's spectrum, got --rope-selection {self.rope_selection} "
                f"--factorization {self.factorization}; use both `attention` (the defaults) or --allocation "
                "uniform"
            )

    @property
    def budget(self) -> KVBudget | None:
        """The KV budget: `kv_budget`, DEFAULT_KV_BUDGET when no rank option is given, else None."""
        if self.kv_budget is not None:
            return KVBudget(self.kv_budget)
        given = (self.kv_lora_rank, self.rope_pairs, self.engine_dims)
        return KVBudget(DEFAULT_KV_BUDGET) if given == (None, None, None) else None

    @property
    def allocation_method(self) -> str:
        """`allocation`, or its default (`default_allocation`: greedy where it applies, else uniform)."""
        if self.allocation is not None:
            return self.allocation
        return default_allocation(
            kv_budget=None if self.budget is None else self.budget.fraction,
            given_ranks=self.rope_pairs is not None or self.kv_lora_rank is not None,
            layout=self.layout,
            selection=self.rope_selection,
            factorization=self.factorization,
        )


@dataclass(frozen=True)
class ExpandSpec:
    """`hf-attn convert expand`: repeat the KV heads up to `num_kv_heads` (None: MHA), exactly."""

    num_kv_heads: int | None = setting(None, help="target KV heads (default: the query heads, MHA)")

    def __post_init__(self):
        if self.num_kv_heads is not None:
            check_num_kv_heads(self.num_kv_heads)


@dataclass(frozen=True)
class RefineSpec:
    """The layer-local refinement after the closed form (`hf-attn refine`, conversion.refine), on the
    conversion's calibration text and device. 0 steps: the closed form only."""

    steps: int = setting(
        REFINE_STEPS,
        flag="--refine-steps",
        help="then refine every layer against the source with N Adam steps (hf-attn refine); 0: the "
        "closed form only",
    )
    tokens: int = setting(REFINE_TOKENS, flag="--refine-tokens", help="calibration tokens of the refinement")
    target: str = setting(
        REFINE_TARGETS[0],
        flag="--refine-target",
        choices=REFINE_TARGETS,
        help="what each refined layer matches: the source layer's output or the residual stream after its "
        "attention (hf-attn refine --target)",
    )
    loss_stride: int = setting(
        LOSS_STRIDE,
        flag="--refine-loss-stride",
        help="each refinement step's loss on every k-th position (hf-attn refine --loss-stride)",
    )
    step_dtype: str = setting(
        STEP_DTYPE,
        flag="--refine-step-dtype",
        choices=("auto", *STEP_DTYPES),
        help="dtype of the refinement steps' matmuls; auto: bfloat16 on a GPU or an AVX-512 CPU, else "
        "float32 (hf-attn refine --step-dtype)",
    )

    def __post_init__(self):
        check_choices(self)
        _check_int("--refine-steps", self.steps, 0)
        _check_int("--refine-tokens", self.tokens, 1)
        _check_int("--refine-loss-stride", self.loss_stride, 1)


@dataclass(frozen=True)
class WriteSpec:
    """How a checkpoint is written: the dtype of its floating weights (None: the source's), whether an
    existing output that hf-attn wrote may be replaced, and the largest shard."""

    save_dtype: str | None = setting(
        None,
        deprecated_flags=("--dtype",),
        help="dtype of the written floating weights (float32, bfloat16, float16; default: the source's)",
    )
    overwrite: bool = setting(False, help="replace an existing --output that hf-attn wrote (a checkpoint)")
    max_shard_bytes: int = setting(DEFAULT_MAX_SHARD_BYTES, cli=False)

    def __post_init__(self):
        if self.save_dtype is not None:
            loading.parse_dtype(self.save_dtype, "--save-dtype")
        _check_int("max_shard_bytes", self.max_shard_bytes, 1)


ConverterSpec = GQASpec | MLASpec | ExpandSpec


def add_spec_arguments(parser: argparse.ArgumentParser, spec: type, *, prefix: str) -> None:
    """The flags of the spec class `spec` (`hf_attn.tooling.cli.add_settings_arguments`), stored under
    `prefix.FIELD` so that specs with a field of the same name share a parser; `spec_from_args` reads them."""
    start = len(parser._actions)
    add_settings_arguments(parser, spec)
    for action in parser._actions[start:]:
        if action.metavar is None and action.choices is None and action.nargs != 0:
            action.metavar = action.option_strings[0].lstrip("-").replace("-", "_").upper()
        action.dest = f"{prefix}.{action.dest}"


def spec_from_args(spec: type, args: argparse.Namespace, *, prefix: str):
    """The spec class `spec` from what `add_spec_arguments(..., prefix=prefix)` parsed (validated: a bad
    value raises UserError naming its flag)."""
    names = [f.name for f in dataclasses.fields(spec)]
    values = {n: getattr(args, f"{prefix}.{n}") for n in names if hasattr(args, f"{prefix}.{n}")}
    return spec(**values)
