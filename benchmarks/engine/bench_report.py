"""The tables of `python -m benchmarks.engine` (benchmarks/engine/bench.py) from its JSON rows: capacity,
decode per concurrency, the decode-step profile and the end-to-end run, source beside MLA export."""

from __future__ import annotations

from benchmarks.engine.bench import NULL_BLOCKS, MiB
from hf_attn.tooling.tables import markdown_table


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


def _blocks(cap: dict) -> str:
    return f"{cap['num_blocks']:,} x {cap['block_size']} = {cap['vllm_tokens']:,}"


def capacity_lines(source: dict, mla: dict) -> list[str]:
    """Capacity: bytes per token, tokens (arithmetic and vLLM's), concurrency (vLLM's and per request)."""
    sc, mc = source["capacity"], mla["capacity"]
    sa, ma = sc["arithmetic"], mc["arithmetic"]
    work = source["workload"]
    req = work["prompt_len"] + work["output_len"]
    s_req, m_req = ((c["num_blocks"] - NULL_BLOCKS) // -(-req // c["block_size"]) for c in (sc, mc))
    rows = [
        (
            "KV bytes per token (config)",
            f"{sa['bytes_per_token']:,}",
            f"{ma['bytes_per_token']:,}",
            _ratio(ma["bytes_per_token"], sa["bytes_per_token"]),
        ),
        (
            "tokens that fit (arithmetic)",
            f"{sa['tokens']:,}",
            f"{ma['tokens']:,}",
            _ratio(ma["tokens"], sa["tokens"]),
        ),
        (
            "vLLM: KV blocks x block size",
            _blocks(sc),
            _blocks(mc),
            _ratio(mc["vllm_tokens"], sc["vllm_tokens"]),
        ),
        (
            "vLLM's log: KV cache size (tokens; max concurrency x max_model_len)",
            f"{sc['kv_cache_tokens']:,}",
            f"{mc['kv_cache_tokens']:,}",
            _ratio(mc["kv_cache_tokens"], sc["kv_cache_tokens"]),
        ),
        (
            f"vLLM: max concurrency at {sc['max_model_len']} tokens",
            f"{sc['max_concurrency']:.2f}",
            f"{mc['max_concurrency']:.2f}",
            _ratio(mc["max_concurrency"], sc["max_concurrency"]),
        ),
        (
            f"requests of {req} tokens running at once (whole blocks, less the null block)",
            s_req,
            m_req,
            _ratio(m_req, s_req),
        ),
    ]
    header = ["", "source (Llama)", "MLA export (deepseek_v3)", "MLA / source"]
    return markdown_table(header, rows, align="llll").splitlines()


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


def _tps(level: dict, fastest: bool = False) -> float | None:
    """Decode tokens/s of a level: concurrency / median step, or / fastest step (`fastest`)."""
    ms = level.get("step_ms_min" if fastest else "step_ms_median")
    return level["concurrency"] / ms * 1e3 if ms else None


def _pair_fmt(a, b, digits: int = 2) -> str:
    return "–" if a is None else f"{_fmt(a, digits)} ({_fmt(b, digits)})"


def _ratios(m: dict, s: dict) -> str:
    med, best = _ratio(_tps(m), _tps(s)), _ratio(_tps(m, True), _tps(s, True))
    return "–" if med == "–" else f"{med} ({best})"


def decode_lines(s_lv: dict, m_lv: dict) -> list[str]:
    """Decode only: step time and tokens/s at each concurrency, from the median and the fastest timed step."""
    lines = [
        "Decode only (steps where every sequence is past its prefill); each cell: from the median step "
        "(from the fastest step, the least disturbed by other processes):",
        "",
    ]
    rows = []
    for c in sorted(set(s_lv) | set(m_lv)):
        s, m = s_lv.get(c, {}), m_lv.get(c, {})
        rows.append(
            [
                c,
                _pair_fmt(s.get("step_ms_median"), s.get("step_ms_min"), 0),
                _pair_fmt(_tps(s), _tps(s, True)),
                _pair_fmt(m.get("step_ms_median"), m.get("step_ms_min"), 0),
                _pair_fmt(_tps(m), _tps(m, True)),
                _ratios(m, s),
            ]
        )
    header = "concurrency | source ms/step | source tok/s | MLA ms/step | MLA tok/s | MLA / source tok/s"
    return lines + markdown_table(header.split(" | "), rows, align="l" * 6).splitlines()


def operating_point_lines(source: dict, mla: dict, saturation: float = 0.9) -> list[str]:
    """Where the smaller cache becomes decode throughput: each model at the most sequences it ran, and the
    concurrency at which the MLA model's decode (fastest steps) reaches `saturation` of its best tokens/s
    (beyond it, more sequences in the cache buy nothing on this device)."""
    s_dec, m_dec = source["decode"], mla["decode"]
    s_top, m_top = _levels(source).get(s_dec["top_level"], {}), _levels(mla).get(m_dec["top_level"], {})
    out = [
        f"- Each model at the most sequences it ran (its cache's maximum, or the sweep's top level): source "
        f"{s_dec['top_level']} (room for {s_dec['max_concurrency_at_horizon']}), "
        f"{_pair_fmt(_tps(s_top), _tps(s_top, True))} tok/s; MLA {m_dec['top_level']} (room for "
        f"{m_dec['max_concurrency_at_horizon']}), {_pair_fmt(_tps(m_top), _tps(m_top, True))} tok/s: "
        f"{_ratios(m_top, s_top)} the source's decode throughput."
    ]
    measured = [lv for lv in m_dec["levels_measured"] if _tps(lv, True)]
    if measured:
        best = max(measured, key=lambda lv: _tps(lv, True))
        knee = min(lv["concurrency"] for lv in measured if _tps(lv, True) >= saturation * _tps(best, True))
        out.append(
            f"- MLA decode (fastest steps) reaches {100 * saturation:.0f}% of its best "
            f"({_tps(best, True):.2f} tok/s at {best['concurrency']} sequences) at {knee} sequences: the KV "
            f"saving turns into throughput where the source's cache holds fewer than {knee} sequences of the "
            "served context."
        )
        gains = [
            (lv["concurrency"], _ratio(_tps(best, True), _tps(lv, True))) for lv in s_dec["levels_measured"]
        ]
        out.append(
            "- Source held to c sequences by its cache (a longer context in the same memory; both measured "
            "at this context), MLA's best decode over the source's (fastest steps): "
            + ", ".join(f"c = {c}: {g}" for c, g in gains if g != "–")
            + "."
        )
    return out


def _profile_lines(s_lv: dict, m_lv: dict, top: int = 6) -> list[str]:
    out = []
    for label, levels in (("source", s_lv), ("MLA", m_lv)):
        for c, level in levels.items():
            if "profile" in level:
                prof = level["profile"]
                ops = ", ".join(
                    f"{t['op']} {100 * t['share']:.0f}%" for t in prof["top"][:top] if t["share"] >= 0.005
                )
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
    rows = [
        (
            "output tokens/s",
            _fmt(s["output_tokens_per_s"], 2),
            _fmt(m["output_tokens_per_s"], 2),
            _ratio(m["output_tokens_per_s"], s["output_tokens_per_s"]),
        ),
        (
            "mean time per output token (ms)",
            _fmt(s["mean_tpot_ms"]),
            _fmt(m["mean_tpot_ms"]),
            _ratio(m["mean_tpot_ms"], s["mean_tpot_ms"]),
        ),
        ("most sequences decoding in one step", s["peak_decode_batch"], m["peak_decode_batch"], ""),
        ("wall time (s)", _fmt(s["wall_s"]), _fmt(m["wall_s"]), ""),
    ]
    table = markdown_table(["", "source", "MLA", "MLA / source"], rows, align="llll")
    return [head, "", *table.splitlines()]


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.engine.bench_report ROWS.json TABLES.md`: the tables again from stored rows."""
    import json
    import sys
    from pathlib import Path

    rows_path, tables_path = (Path(a) for a in (argv if argv is not None else sys.argv[1:]))
    tables_path.write_text(markdown(json.loads(rows_path.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
