"""The tables of `hf-attn bench engine` (eval/engine/bench.py) from its JSON rows: capacity, decode per
concurrency, the decode-step profile and the end-to-end run, source beside MLA export."""

from __future__ import annotations

from hf_attn.eval.engine.bench import NULL_BLOCKS, MiB


def markdown(rows: list[dict]) -> str:
    """Every pair's tables, with the command and date of each."""
    parts = []
    for name in dict.fromkeys(r["pair"] for r in rows):
        by_role = {r["model"]: r for r in rows if r["pair"] == name}
        if {"source", "mla"} <= set(by_role):
            source = by_role["source"]
            parts.append(
                f"`{source['command']}` ({source['date']})\n\n" + pair_markdown(source, by_role["mla"])
            )
    return "\n\n".join(parts) + "\n"


def _fmt(x, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _ratio(a, b) -> str:
    return "–" if not a or not b else f"{a / b:.2f}x"


def _levels(row: dict) -> dict[int, dict]:
    return {level["concurrency"]: level for level in row["decode"]["levels_measured"]}


def _row(label: str, source, mla, ratio: str) -> str:
    return f"| {label} | {source} | {mla} | {ratio} |"


def _blocks(cap: dict) -> str:
    return f"{cap['num_blocks']:,} x {cap['block_size']} = {cap['vllm_tokens']:,}"


def capacity_lines(source: dict, mla: dict) -> list[str]:
    """Capacity: bytes per token, tokens (arithmetic and vLLM's), concurrency (vLLM's and per request)."""
    sc, mc = source["capacity"], mla["capacity"]
    sa, ma = sc["arithmetic"], mc["arithmetic"]
    work = source["workload"]
    req = work["prompt_len"] + work["output_len"]
    s_req, m_req = ((c["num_blocks"] - NULL_BLOCKS) // -(-req // c["block_size"]) for c in (sc, mc))
    return [
        "| | source (Llama) | MLA export (deepseek_v3) | MLA / source |",
        "|---|---|---|---|",
        _row(
            "KV bytes per token (config)",
            f"{sa['bytes_per_token']:,}",
            f"{ma['bytes_per_token']:,}",
            _ratio(ma["bytes_per_token"], sa["bytes_per_token"]),
        ),
        _row(
            "tokens that fit (arithmetic)",
            f"{sa['tokens']:,}",
            f"{ma['tokens']:,}",
            _ratio(ma["tokens"], sa["tokens"]),
        ),
        _row(
            "vLLM: KV blocks x block size",
            _blocks(sc),
            _blocks(mc),
            _ratio(mc["vllm_tokens"], sc["vllm_tokens"]),
        ),
        _row(
            f"vLLM: max concurrency at {sc['max_model_len']} tokens",
            f"{sc['max_concurrency']:.2f}",
            f"{mc['max_concurrency']:.2f}",
            _ratio(mc["max_concurrency"], sc["max_concurrency"]),
        ),
        _row(
            f"requests of {req} tokens running at once (whole blocks, less the null block)",
            s_req,
            m_req,
            _ratio(m_req, s_req),
        ),
    ]


def pair_markdown(source: dict, mla: dict) -> str:
    """The pair's tables: capacity, decode per concurrency, decode profile, end to end."""
    sc, mc = source["capacity"], mla["capacity"]
    lines = [
        f"**{source['pair']}**: {source['note']}; {source['dtype']}, "
        f"{source['kv_cache_bytes'] / MiB:g} MiB of KV cache each; attention backends "
        f"{sc['attention_backend']} (source), {mc['attention_backend']} (MLA)",
        "",
        *capacity_lines(source, mla),
    ]
    s_lv, m_lv = _levels(source), _levels(mla)
    lines += ["", *decode_lines(s_lv, m_lv), "", *operating_point_lines(source, mla)]
    lines += ["", *_profile_lines(s_lv, m_lv), "", *_batch_lines(source, mla)]
    return "\n".join(lines)


def decode_lines(s_lv: dict, m_lv: dict) -> list[str]:
    """Decode only: step time (median and fastest of the timed steps) and tokens/s at each concurrency."""
    lines = [
        "Decode only (steps where every sequence is past its prefill; ms/step: median (fastest)):",
        "",
        "| concurrency | source ms/step | source tok/s | MLA ms/step | MLA tok/s | MLA / source tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for c in sorted(set(s_lv) | set(m_lv)):
        s, m = s_lv.get(c, {}), m_lv.get(c, {})
        lines.append(
            f"| {c} | {_step(s)} | {_fmt(s.get('decode_tokens_per_s'), 2)} | {_step(m)} | "
            f"{_fmt(m.get('decode_tokens_per_s'), 2)} | "
            f"{_ratio(m.get('decode_tokens_per_s'), s.get('decode_tokens_per_s'))} |"
        )
    return lines


def _step(level: dict) -> str:
    if not level.get("step_ms_median"):
        return "–"
    return f"{level['step_ms_median']:,.0f} ({level['step_ms_min']:,.0f})"


def operating_point_lines(source: dict, mla: dict, saturation: float = 0.9) -> list[str]:
    """Where the smaller cache becomes decode throughput: each model at its own maximum concurrency, and the
    concurrency at which the MLA model's decode reaches `saturation` of its best tokens/s (beyond it, more
    sequences in the cache buy nothing on this device)."""
    best = {}
    for role, row in (("source", source), ("mla", mla)):
        levels = [lv for lv in row["decode"]["levels_measured"] if lv.get("decode_tokens_per_s")]
        best[role] = max(levels, key=lambda lv: lv["decode_tokens_per_s"], default=None)
    s_top = _levels(source).get(source["decode"]["top_level"], {})
    m_top = _levels(mla).get(mla["decode"]["top_level"], {})
    s_dec, m_dec = source["decode"], mla["decode"]
    ratio = _ratio(m_top.get("decode_tokens_per_s"), s_top.get("decode_tokens_per_s"))
    out = [
        f"- Each model at the most sequences it ran (its cache's maximum, or the sweep's top level): source "
        f"{s_dec['top_level']} (room for {s_dec['max_concurrency_at_horizon']}), "
        f"{_fmt(s_top.get('decode_tokens_per_s'), 2)} tok/s; MLA {m_dec['top_level']} (room for "
        f"{m_dec['max_concurrency_at_horizon']}), {_fmt(m_top.get('decode_tokens_per_s'), 2)} tok/s: "
        f"{ratio} the source's decode throughput."
    ]
    if best["mla"]:
        peak = best["mla"]["decode_tokens_per_s"]
        knee = min(
            lv["concurrency"]
            for lv in mla["decode"]["levels_measured"]
            if (lv.get("decode_tokens_per_s") or 0) >= saturation * peak
        )
        out.append(
            f"- MLA decode reaches {100 * saturation:.0f}% of its best ({peak:.2f} tok/s at "
            f"{best['mla']['concurrency']} sequences) at {knee} sequences: the KV saving turns into "
            f"throughput where the source's cache holds fewer than {knee} sequences of the served context."
        )
    return out


def _profile_lines(s_lv: dict, m_lv: dict, top: int = 6) -> list[str]:
    out = []
    for label, levels in (("source", s_lv), ("MLA", m_lv)):
        for c, level in levels.items():
            if "profile" in level:
                prof = level["profile"]
                ops = ", ".join(f"{t['op']} {100 * t['share']:.0f}%" for t in prof["top"][:top])
                out.append(
                    f"- decode step profile, {label} at concurrency {c} ({prof['device']}, "
                    f"{prof['total_ms_per_step']:.0f} ms/step of op self time): {ops}"
                )
    return out


def _batch_lines(source: dict, mla: dict) -> list[str]:
    s, m = source["batch"], mla["batch"]
    head = (
        f"End to end: {s['num_requests']} requests of {s['prompt_len']} + {s['output_len']} tokens, "
        "all submitted at once:"
    )
    return [
        head,
        "",
        "| | source | MLA | MLA / source |",
        "|---|---|---|---|",
        f"| output tokens/s | {_fmt(s['output_tokens_per_s'], 2)} | {_fmt(m['output_tokens_per_s'], 2)} |"
        f" {_ratio(m['output_tokens_per_s'], s['output_tokens_per_s'])} |",
        f"| mean time per output token (ms) | {_fmt(s['mean_tpot_ms'])} | {_fmt(m['mean_tpot_ms'])} |"
        f" {_ratio(m['mean_tpot_ms'], s['mean_tpot_ms'])} |",
        f"| most sequences decoding in one step | {s['peak_decode_batch']} | {m['peak_decode_batch']} | |",
        f"| wall time (s) | {_fmt(s['wall_s'])} | {_fmt(m['wall_s'])} | |",
    ]
