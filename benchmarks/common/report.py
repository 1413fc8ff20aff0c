"""Ratios, targets and the terminal table, from the runs' summaries (plain dicts, as in the JSON)."""

from __future__ import annotations

from typing import Any

BASE = "static+paged"
HF_STATIC = "hf static"
HF_CONT = "hf continuous"
MAIN = "continuous+paged"
OVERHEAD_RUN = "continuous+paged@{n}"


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    def ratio(name: str, ref: str) -> float | None:
        if name not in runs or ref not in runs or not runs[ref]["tokens_per_s"]:
            return None
        return runs[name]["tokens_per_s"] / runs[ref]["tokens_per_s"]

    return {name: {"vs_static_paged": ratio(name, BASE), "vs_hf_static": ratio(name, HF_STATIC)} for name in runs}


def targets(runs: dict[str, dict[str, Any]], ideal: float, overhead_run: str | None) -> dict[str, dict[str, Any]]:
    """Each target of the issue: the measured value, the bar, and whether it is met (None: not measured)."""

    def get(name: str, key: str) -> float | None:
        return runs.get(name, {}).get(key)

    def tps_ratio(a: str, b: str) -> float | None:
        x, y = get(a, "tokens_per_s"), get(b, "tokens_per_s")
        return x / y if x and y else None

    cont_static = tps_ratio(MAIN, BASE)
    rows = {
        "continuous/static >= 0.9 x ideal": (cont_static / ideal if cont_static else None, 0.9, ">="),
        "occupancy while queued >= 95%": (get(MAIN, "occupancy_while_queued"), 0.95, ">="),
        ">= 10x HF static": (tps_ratio(MAIN, HF_STATIC), 10.0, ">="),
        ">= 1.5x HF continuous": (tps_ratio(MAIN, HF_CONT), 1.5, ">="),
        "engine overhead <= 5% at full batch": (
            get(overhead_run, "overhead_share_full_batch") if overhead_run else None,
            0.05,
            "<=",
        ),
    }
    out = {}
    for label, (value, bar, op) in rows.items():
        met = None if value is None else (value >= bar if op == ">=" else value <= bar)
        out[label] = {"value": value, "target": bar, "met": met}
    return out


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def table(runs: dict[str, dict[str, Any]], markdown: bool = False) -> str:
    rat = ratios(runs)
    head = [
        "run",
        "out tok/s",
        "× static+paged",
        "× HF static",
        "occupancy (queued)",
        "peak seqs",
        "peak KV blocks",
        "preempt",
        "overhead",
        "TTFT p50 / p99 s",
        "latency p50 / p99 s",
        "CPU taken by others",
    ]
    rows = []
    for name, r in runs.items():
        kv = "—" if r.get("peak_kv_blocks") is None else f"{r['peak_kv_blocks']}/{r['kv_blocks_total']}"
        rows.append(
            [
                name,
                _fmt(r["tokens_per_s"], ".0f"),
                _fmt(rat[name]["vs_static_paged"], ".2f", "×"),
                _fmt(rat[name]["vs_hf_static"], ".1f", "×"),
                _pct(r.get("occupancy_while_queued")),
                _fmt(r.get("peak_running"), "d"),
                kv,
                _fmt(r.get("preemptions"), "d"),
                _pct(r.get("overhead_share")),
                f"{_fmt(r['ttft_s']['p50'])} / {_fmt(r['ttft_s']['p99'])}",
                f"{_fmt(r['latency_s']['p50'])} / {_fmt(r['latency_s']['p99'])}",
                _pct(r.get("contention")),
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in rows])


def targets_text(tg: dict[str, dict[str, Any]]) -> str:
    lines = []
    for label, t in tg.items():
        mark = {True: "MET   ", False: "MISSED", None: "n/a   "}[t["met"]]
        value = "not measured" if t["value"] is None else f"{t['value']:.3g}"
        lines.append(f"  {mark} {label}: {value}")
    return "\n".join(lines)
