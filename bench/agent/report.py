"""Summaries of a level's results, the Markdown table, and the JSON record."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

from .loadgen import OUTCOMES, Result


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    # Nearest-rank on the sorted sample: with few requests p99 is the worst one, not an extrapolation.
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))]


def summarize(results: list[Result], wall: float) -> dict:
    """Counts of each outcome, latency percentiles (seconds) and throughput (tokens/s over the wall time)."""
    ok = [r for r in results if r.outcome == "ok"]
    counts = {k: sum(r.outcome == k for r in results) for k in OUTCOMES}
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itl]
    e2e = [r.e2e for r in ok]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "requests": len(results), **counts,
        "tool_calls": sum(r.tool_call for r in ok),
        "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
        "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99),
        "e2e_p50": _pct(e2e, 50), "e2e_p99": _pct(e2e, 99),
        "prompt_tokens": in_tok, "cached_tokens": sum(cached) if cached else None, "output_tokens": out_tok,
        "wall_s": wall,
        "output_tok_s": out_tok / wall if wall > 0 else 0.0,
        "total_tok_s": (in_tok + out_tok) / wall if wall > 0 else 0.0,
        "errors": [r.detail for r in results if r.outcome != "ok"][:5],
    }


def merge_repeats(runs: list[dict]) -> dict:
    """Repeats of one level: counts are summed, every other number is the median across repeats."""
    if len(runs) == 1:
        return dict(runs[0], repeats=1)
    out = {"repeats": len(runs)}
    for k, v in runs[0].items():
        vals = [r[k] for r in runs if r.get(k) is not None]
        if k in ("requests", "tool_calls", *OUTCOMES):
            out[k] = sum(vals)
        elif k == "errors":
            out[k] = [e for r in runs for e in r[k]][:5]
        elif isinstance(v, (int, float)) or v is None:
            out[k] = statistics.median(vals) if vals else None
    # The spread between repeats: the noise floor the table is read against.
    out["total_tok_s_range"] = [min(r["total_tok_s"] for r in runs), max(r["total_tok_s"] for r in runs)]
    return out


def _f(x, unit=""):
    if x is None:
        return "–"
    return f"{x:.2f}{unit}" if x < 100 else f"{x:.0f}{unit}"


def _count(x) -> str:
    return "–" if x is None else f"{x:.0f}"


def table(rows: list[dict]) -> str:
    """rows: dicts with server, concurrency, and a merged summary."""
    head = ("| server | conc | ok/total | http err | dropped | empty | tool calls | TTFT p50 | TTFT p99 "
            "| ITL p50 | ITL p99 | E2E p50 | E2E p99 | out tok/s | total tok/s | prompt tokens | cached tokens "
            "| peak RSS MiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['ok']}/{r['requests']} | {r['http_error']} "
            f"| {r['dropped']} | {r['empty']} | {r['tool_calls']} | {_f(r['ttft_p50'], 's')} "
            f"| {_f(r['ttft_p99'], 's')} | {_f(r['itl_p50'], 's')} | {_f(r['itl_p99'], 's')} "
            f"| {_f(r['e2e_p50'], 's')} | {_f(r['e2e_p99'], 's')} | {_f(r['output_tok_s'])} "
            f"| {_f(r['total_tok_s'])} | {r['prompt_tokens']:.0f} | {_count(r['cached_tokens'])} "
            f"| {_f(r.get('peak_rss_mib'))} |")
    return "\n".join(lines)


def ratios(rows: list[dict], ours: str = "mlxd") -> str:
    """mlxd's TTFT p50 and total tokens/s relative to each peer at each concurrency."""
    by = {(r["server"], r["concurrency"]): r for r in rows}
    lines = ["| vs peer | conc | TTFT p50 (peer / mlxd; >1: mlxd faster) | total tok/s (mlxd / peer) "
             "| success mlxd / peer |", "|---|---|---|---|---|"]
    for (server, c), p in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        m = by.get((ours, c))
        if server == ours or m is None:
            continue
        t = (p["ttft_p50"] / m["ttft_p50"]) if p["ttft_p50"] and m["ttft_p50"] else None
        x = (m["total_tok_s"] / p["total_tok_s"]) if p["total_tok_s"] else None
        lines.append(f"| {server} | {c} | {_f(t, '×')} | {_f(x, '×')} "
                     f"| {m['ok']}/{m['requests']} vs {p['ok']}/{p['requests']} |")
    return "\n".join(lines)


def machine() -> dict:
    import os

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    from importlib import metadata

    for pkg in ("mlxd", "mlx", "mlx-lm"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:  # a peer's package missing only means that peer is not run
            pass
    return info


def write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str))
