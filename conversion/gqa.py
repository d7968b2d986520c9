"""MHA/GQA -> GQA/MQA: pool H key/value heads into G groups (Ainslie et al. 2023), or a calibrated variant.

    python -m conversion.gqa --model SRC --num-kv-heads G --output DST [--method mean|calibrated]
        [--calibration-text FILE ...] [--calibration-tokens N] [--dtype float32|bfloat16] [--overwrite]

Group g of G takes the source KV heads g*H/G ... (g+1)*H/G - 1 (the order of transformers' `repeat_kv`:
query head h reads KV head h // (Hq/G) after the conversion, as it read h // (Hq/H) before).

method="mean" (the GQA paper): each group's K and V projection rows (and biases) are the mean of its heads',
accumulated in float64 and cast back, so pooling identical heads returns them bit for bit. Query and output
projections are untouched. Streams tensor by tensor: memory is one tensor (see conversion/bench_stream.py).

method="calibrated" (beyond the paper): the pooled K/V projections are fitted on calibration activations so
that what attention computes changes least, and the query / output projections are refitted to read them.
Notation per group: r = H/G source heads h, d = head_dim, x the attention input, [x; 1] its augmented form
with second moment M (conversion.calibration.attention_input_moments).
- Keys. RoPE rotates each pair (i, i + d/2) of every head by the same angle: written as one complex number
  z_{h,i} = k_{h,i} + j k_{h,i+d/2}, it multiplies z by exp(j theta_i t). So the only linear maps of the
  stacked group keys that commute with RoPE combine, pair by pair, the r complex numbers of equal frequency
  with complex coefficients. For each pair i the pooled key is z'_i = sum_h c_{h,i} z_{h,i}, and query head
  h' (reading source head h) becomes q'_{h',i} = conj(u_{h,i}) q_{h',i}, so that its score term
  Re(conj(q) z_h) ~ Re(conj(q') z'). Averaged over relative rotations, the score error of pair i is
  E|q_{h',i}|^2 E|z_{h,i} - u_{h,i} z'_i|^2 / 2: minimising it is a PCA (top complex eigenvector) of the
  r x r key covariance of pair i, each head weighted by the power of the queries that read it; u is the
  least-squares decoder. Exact if the group's keys are rank one per pair, e.g. identical heads.
- Values. Head h' adds O_{h'} v_h to the output, so the value error that matters is sum_{h'} |O_{h'} dv_h|^2:
  whiten each head's values by R_h = (sum_{h' reads h} O_{h'}^T O_{h'})^{1/2}, take the top d principal
  directions of the stacked whitened values (r d dims) as the pooled value head, and refit each head's
  output columns by least squares (O'_{h'} = O_{h'} E[v_h v'^T] E[v' v'^T]^{-1}).
Everything follows from M, so calibration needs one forward pass of the source model (fp32) over the
calibration tokens and keeps per layer a (C+1)^2 float64 matrix; the weights are then streamed, one layer's
attention tensors at a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from conversion import calibration as cal
from conversion.checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    AttentionGeometry,
    TensorInfo,
    add_record,
    attn_key,
    check_attention_tensors,
    check_supported,
    dtype_name,
    expected_attention_shapes,
    names_in_file_order,
    parse_attn_key,
    read_config,
    read_tensor,
    resolve_model_path,
    save_streamed,
    tensor_index,
    torch_dtype,
)
from hf_attn.files import checkpoint_hash

METHODS = ("mean", "calibrated")
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
_RIDGE = 1e-9  # relative ridge on the covariances that are inverted or square-rooted


@dataclass(frozen=True)
class Pooling:
    """H source KV heads pooled into G groups of r = H / G consecutive heads."""

    geometry: AttentionGeometry  # of the source
    num_groups: int  # G

    @property
    def heads_per_group(self) -> int:
        return self.geometry.num_kv_heads // self.num_groups

    @property
    def groups(self) -> list[list[int]]:
        r = self.heads_per_group
        return [list(range(g * r, (g + 1) * r)) for g in range(self.num_groups)]

    def query_heads_of(self, kv_head: int) -> list[int]:
        """Query heads that read source KV head `kv_head` (repeat_kv order)."""
        n = self.geometry.group_size
        return list(range(kv_head * n, (kv_head + 1) * n))


def check_pooling(geometry: AttentionGeometry, num_kv_heads: int) -> Pooling:
    """Validate the target number of KV heads G against the source's H; ValueError naming both otherwise."""
    h = geometry.num_kv_heads
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"--num-kv-heads must be a positive integer, got {num_kv_heads!r}")
    if num_kv_heads > h:
        raise ValueError(
            f"--num-kv-heads {num_kv_heads} is larger than the source's {h} KV heads: pooling only reduces "
            f"them; to add KV heads use `python -m conversion.expand --num-kv-heads {num_kv_heads}`."
        )
    if h % num_kv_heads:
        divisors = [g for g in range(1, h + 1) if h % g == 0]
        raise ValueError(
            f"The source's {h} KV heads cannot be split into {num_kv_heads} equal groups "
            f"({h} % {num_kv_heads} != 0); choose --num-kv-heads in {divisors}."
        )
    return Pooling(geometry, num_kv_heads)


# ----------------------------------------------------------------------------------------- mean pooling


@torch.inference_mode()
def mean_pool_heads(tensor: torch.Tensor, *, pooling: Pooling) -> torch.Tensor:
    """K or V projection weight (H*d, C) or bias (H*d,) -> (G*d, C) or (G*d,): the mean over each group.

    Accumulated in float64 and cast back to the input dtype.
    """
    g, r, d = pooling.num_groups, pooling.heads_per_group, pooling.geometry.head_dim
    assert tensor.shape[0] == g * r * d, (tuple(tensor.shape), g, r, d)
    rest = tuple(tensor.shape[1:])
    grouped = tensor.reshape(g, r, d, *rest)  # (G, r, d, C) or (G, r, d)
    return grouped.double().mean(dim=1).to(tensor.dtype).reshape(g * d, *rest)  # (G*d, C) or (G*d,)


# ----------------------------------------------------------------------------------------- calibrated pooling


def _augment(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[W | b] in float64: (out, C) and (out,) -> (out, C + 1); a missing bias is a zero column."""
    w = weight.double()
    b = bias.double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    return torch.cat([w, b[:, None]], dim=1)  # (out, C + 1)


def _split(augmented: torch.Tensor, like_bias: torch.Tensor | None, dtype: torch.dtype):
    """Inverse of `_augment`: (out, C + 1) -> weight (out, C) and bias (out,) or None; cast to `dtype`."""
    weight, bias = augmented[:, :-1], augmented[:, -1]
    if like_bias is None:
        assert bias.abs().max() <= 1e-6 * max(weight.abs().max().item(), 1.0), "bias appeared from nowhere"
        return weight.to(dtype).contiguous(), None
    return weight.to(dtype).contiguous(), bias.to(dtype).contiguous()


def _sym_sqrt(a: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of a PSD matrix (eigenvalues clipped at a relative ridge)."""
    evals, evecs = torch.linalg.eigh(a)
    evals = evals.clamp_min(_RIDGE * evals.max().clamp_min(1e-300))
    return (evecs * evals.sqrt()) @ evecs.T


@torch.inference_mode()
def calibrated_pool_layer(
    *,
    weights: dict[str, torch.Tensor | None],
    moment: torch.Tensor,
    pooling: Pooling,
    key_moments: torch.Tensor | None = None,
    value_moments: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """Pool one attention layer's K/V heads, refitting Q and O (see the module docstring for the math).

    weights: "q_proj.weight" (Hq*d, C), "k_proj.weight"/"v_proj.weight" (H*d, C), "o_proj.weight" (C, Hq*d),
    and "q_proj.bias"/"k_proj.bias"/"v_proj.bias" ((out,) or None). moment: (C+1, C+1), sum of [x;1][x;1]^T.
    Returns the same keys with K/V at G heads; dtypes as given.
    """
    geo, g_count, r = pooling.geometry, pooling.num_groups, pooling.heads_per_group
    d, half, hq = geo.head_dim, geo.head_dim // 2, geo.num_heads
    dtype = weights["k_proj.weight"].dtype
    if r == 1:  # nothing to pool: the identity
        return dict(weights)
    m = moment.double() / moment[-1, -1].double()  # (C+1, C+1), E[[x;1][x;1]^T]
    norm = lambda t: t.double() / t[..., -1:, -1:].double()  # noqa: E731
    mk = norm(key_moments) if key_moments is not None else m.expand(geo.num_kv_heads, *m.shape)
    mv = norm(value_moments) if value_moments is not None else m.expand(geo.num_kv_heads, *m.shape)
    wq = _augment(weights["q_proj.weight"], weights.get("q_proj.bias"))  # (Hq*d, C+1)
    wk = _augment(weights["k_proj.weight"], weights.get("k_proj.bias"))  # (H*d, C+1)
    wv = _augment(weights["v_proj.weight"], weights.get("v_proj.bias"))  # (H*d, C+1)
    wo = weights["o_proj.weight"].double()  # (C, Hq*d)
    ca = wq.shape[1]

    # complex view of the rotary pairs: row i + j * row (i + d/2) of every head
    qc = wq.reshape(hq, 2, half, ca)  # (Hq, 2, d/2, C+1)
    qc = torch.complex(qc[:, 0], qc[:, 1])  # (Hq, d/2, C+1)
    kc = wk.reshape(geo.num_kv_heads, 2, half, ca)  # (H, 2, d/2, C+1)
    kc = torch.complex(kc[:, 0], kc[:, 1])  # (H, d/2, C+1)
    mc = m.to(torch.complex128)
    q_power = ((qc @ mc) * qc.conj()).sum(-1).real  # (Hq, d/2): E|q_{h',i}|^2

    new_qc = qc.clone()  # (Hq, d/2, C+1)
    new_kc = torch.empty(g_count, half, ca, dtype=torch.complex128)  # (G, d/2, C+1)
    new_v = torch.empty(g_count * d, ca, dtype=torch.float64)  # (G*d, C+1)
    new_o = wo.clone()  # (C, Hq*d)
    for g, heads in enumerate(pooling.groups):
        # keys: per pair, weighted complex PCA over the r heads of the group
        a = kc[heads].transpose(0, 1)  # (d/2, r, C+1)
        mkg = mk[heads].mean(0).to(torch.complex128)  # (C+1, C+1)
        cov = a @ mkg @ a.conj().transpose(1, 2)  # (d/2, r, r): E[z z^H]
        w = torch.stack([q_power[pooling.query_heads_of(h)].sum(0) for h in heads], dim=1)  # (d/2, r)
        sw = w.clamp_min(_RIDGE * w.max()).sqrt()  # (d/2, r)
        _, evecs = torch.linalg.eigh(sw[:, :, None] * cov * sw[:, None, :])  # ascending: top is last
        coef = evecs[:, :, -1].conj() * sw  # (d/2, r): z' = sum_h coef_h z_h
        phase = coef.sum(-1)  # (d/2,) rotate so that sum_h coef_h is real positive: z' resembles the mean
        unit = torch.where(phase.abs() > 0, phase / phase.abs(), torch.ones_like(phase))  # (d/2,)
        coef = coef * unit.conj()[:, None]
        k_new = (coef[:, :, None] * a).sum(1)  # (d/2, C+1)
        power_new = ((k_new @ mkg) * k_new.conj()).sum(-1).real  # (d/2,)
        power_old = torch.diagonal(cov, dim1=1, dim2=2).real.mean(-1)  # (d/2,)
        k_new = k_new * (power_old / power_new.clamp_min(1e-300)).sqrt()[:, None]  # same RMS as the heads
        new_kc[g] = k_new
        cross = (a @ mkg @ k_new.conj()[:, :, None]).squeeze(-1)  # (d/2, r): E[z_h conj(z')]
        power_new = ((k_new @ mkg) * k_new.conj()).sum(-1).real  # (d/2,)
        u = cross / power_new.clamp_min(1e-300)[:, None]  # (d/2, r): z_h ~ u_h z'
        for j, h in enumerate(heads):
            for hp in pooling.query_heads_of(h):
                new_qc[hp] = u[:, j].conj()[:, None] * qc[hp]

        # values: output-weighted PCA of the stacked values, least-squares refit of the output columns
        va = wv.reshape(geo.num_kv_heads, d, ca)[heads]  # (r, d, C+1)
        roots = []
        for h in heads:
            cols = [wo[:, hp * d : (hp + 1) * d] for hp in pooling.query_heads_of(h)]  # each (C, d)
            roots.append(_sym_sqrt(sum(c.T @ c for c in cols)))  # (d, d)
        whitened = torch.cat([roots[j] @ va[j] for j in range(r)])  # (r*d, C+1)
        mg = mv[heads].mean(0)  # (C+1, C+1)
        cov_v = whitened @ mg @ whitened.T  # (r*d, r*d)
        _, evecs_v = torch.linalg.eigh(cov_v)
        top = evecs_v[:, -d:].flip(-1)  # (r*d, d), largest first
        v_new = top.T @ whitened  # (d, C+1)
        rms_old = torch.einsum("rdc,ce,rde->", va, mg, va) / (r * d)
        rms_new = torch.einsum("dc,ce,de->d", v_new, mg, v_new)  # (d,)
        v_new = v_new * (rms_old / rms_new.clamp_min(1e-300)).sqrt()[:, None]
        new_v[g * d : (g + 1) * d] = v_new
        for j, h in enumerate(heads):
            gram = v_new @ mv[h] @ v_new.T  # (d, d): E[v' v'^T]
            gram = gram + _RIDGE * torch.diagonal(gram).mean() * torch.eye(d, dtype=gram.dtype)
            decode = torch.linalg.solve(gram, v_new @ mv[h] @ va[j].T).T  # (d, d): v_h ~ decode v'
            for hp in pooling.query_heads_of(h):
                new_o[:, hp * d : (hp + 1) * d] = wo[:, hp * d : (hp + 1) * d] @ decode

    q_rows = torch.cat([new_qc.real, new_qc.imag], dim=1).reshape(hq * d, ca)  # (Hq*d, C+1)
    k_rows = torch.cat([new_kc.real, new_kc.imag], dim=1).reshape(g_count * d, ca)  # (G*d, C+1)
    out: dict[str, torch.Tensor | None] = {}
    out["q_proj.weight"], out["q_proj.bias"] = _split(q_rows, weights.get("q_proj.bias"), dtype)
    out["k_proj.weight"], out["k_proj.bias"] = _split(k_rows, weights.get("k_proj.bias"), dtype)
    out["v_proj.weight"], out["v_proj.bias"] = _split(new_v, weights.get("v_proj.bias"), dtype)
    out["o_proj.weight"] = new_o.to(weights["o_proj.weight"].dtype).contiguous()
    return out


# ----------------------------------------------------------------------------------------- conversion


def _layer_names(layer: int) -> dict[str, str]:
    """ "q_proj.weight" ... -> the checkpoint names of one layer's attention tensors."""
    return {f"{p}.{k}": attn_key(layer, p, k) for p in _PROJ for k in ("weight", "bias")}


def _pooled_tensors(
    index: dict[str, TensorInfo], pooling: Pooling, method: str, stats: dict[int, dict] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The converted checkpoint's tensors in source file order; one tensor (mean) or one layer's attention
    tensors (calibrated) in memory at a time."""
    geo = pooling.geometry
    shapes = expected_attention_shapes(
        AttentionGeometry(geo.num_layers, geo.hidden_size, geo.num_heads, pooling.num_groups, geo.head_dim)
    )
    done: set[int] = set()
    for name in tqdm(names_in_file_order(index), desc=f"gqa ({method})", unit="tensor"):
        parsed = parse_attn_key(name)
        if parsed is None:
            yield name, read_tensor(index[name])
            continue
        layer, proj, kind = parsed
        if method == "mean":
            tensor = read_tensor(index[name])
            if proj in ("k_proj", "v_proj"):
                tensor = mean_pool_heads(tensor, pooling=pooling)
            assert tuple(tensor.shape) == shapes[proj, kind], (name, tuple(tensor.shape))
            yield name, tensor
            del tensor  # hold one tensor at a time
            continue
        if layer in done:
            continue
        done.add(layer)
        full = _layer_names(layer)
        weights = {k: read_tensor(index[n]) if n in index else None for k, n in full.items()}
        new = calibrated_pool_layer(weights=weights, pooling=pooling, **stats[layer])
        for key, tensor in new.items():
            if tensor is not None:
                proj_, kind_ = key.split(".")
                assert tuple(tensor.shape) == shapes[proj_, kind_], (full[key], tuple(tensor.shape))
                yield full[key], tensor


def calibration_statistics(
    *, src_dir: Path, files: list[Path] | None, tokens: int, window: int, layers: int
) -> dict[int, dict]:
    """Per layer, the keyword arguments of `calibrated_pool_layer` (moments) from one fp32 forward pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src_dir)
    ids = cal.calibration_ids(tokenizer, files, tokens)
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32).eval()
    moments = cal.attention_input_moments(model, ids, window=window)
    assert sorted(moments) == list(range(layers)), sorted(moments)
    return {layer: {"moment": m} for layer, m in moments.items()}


def convert_gqa(
    *,
    src: str | Path | None,
    dst: str | Path,
    num_kv_heads: int,
    method: str = "mean",
    calibration_files: list[str | Path] | None = None,
    calibration_tokens: int = cal.DEFAULT_CALIBRATION_TOKENS,
    calibration_window: int = cal.DEFAULT_WINDOW,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `dst`: checkpoint `src` with its KV heads pooled into `num_kv_heads` groups by `method`."""
    start = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"Unknown --method {method!r}; choose one of {', '.join(METHODS)}.")
    src_dir = resolve_model_path(src)
    config = read_config(src_dir)
    check_supported(config)
    geometry = AttentionGeometry.from_config(config)
    pooling = check_pooling(geometry, num_kv_heads)
    index = tensor_index(src_dir)
    check_attention_tensors(index, geometry)
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    if Path(dst).expanduser().exists() and not overwrite:  # fail before any slow calibration
        raise FileExistsError(f"Output {dst} already exists; pass --overwrite to replace it.")
    record = {
        "converter": "conversion.gqa",
        "method": method,
        "source": str(src_dir),
        "source_checkpoint_hash": checkpoint_hash(src_dir),
        "num_key_value_heads": {"from": geometry.num_kv_heads, "to": num_kv_heads},
        "groups": pooling.groups,
        "calibration": None,
        "dtype": dtype_name(dtype) if dtype is not None else config.get("dtype", config.get("torch_dtype")),
    }
    stats = None
    if method == "calibrated" and pooling.heads_per_group > 1:
        files = None if calibration_files is None else [Path(f) for f in calibration_files]
        stats = calibration_statistics(
            src_dir=src_dir,
            files=files,
            tokens=calibration_tokens,
            window=calibration_window,
            layers=geometry.num_layers,
        )
        record["calibration"] = {**cal.corpus_record(files, calibration_tokens), "window": calibration_window}
    new_config = add_record({**config, "num_key_value_heads": num_kv_heads}, record)
    out = save_streamed(
        src_dir=src_dir,
        dst=dst,
        tensors=_pooled_tensors(index, pooling, method if stats is not None else "mean", stats),
        config=new_config,
        overwrite=overwrite,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
    )
    seconds = time.perf_counter() - start
    print(f"pooled {geometry.num_kv_heads} -> {num_kv_heads} KV heads ({method}) in {seconds:.1f} s: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conversion.gqa", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir or hub id (default: embedded SmolLM2)")
    parser.add_argument("--num-kv-heads", type=int, required=True, help="G, the KV heads after pooling")
    parser.add_argument("--output", required=True, help="directory of the converted checkpoint")
    parser.add_argument("--method", choices=METHODS, default="mean")
    parser.add_argument(
        "--calibration-text",
        nargs="+",
        default=None,
        metavar="FILE",
        help="calibration text files (default: the five Austen novels other than Persuasion)",
    )
    parser.add_argument("--calibration-tokens", type=int, default=cal.DEFAULT_CALIBRATION_TOKENS)
    parser.add_argument("--calibration-window", type=int, default=cal.DEFAULT_WINDOW)
    parser.add_argument("--dtype", default=None, help="cast floating weights (float32, bfloat16, float16)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    args = parser.parse_args(argv)
    try:
        convert_gqa(
            src=args.model,
            dst=args.output,
            num_kv_heads=args.num_kv_heads,
            method=args.method,
            calibration_files=args.calibration_text,
            calibration_tokens=args.calibration_tokens,
            calibration_window=args.calibration_window,
            dtype=args.dtype,
            overwrite=args.overwrite,
        )
    except (ValueError, OSError, KeyError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
