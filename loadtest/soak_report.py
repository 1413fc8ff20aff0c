"""The soak's report: requests paired from the events file, per-window statistics, the targets evaluated
(PASS/MISS), the JSON summary and one figure with a panel per quantity (fault windows shaded).

Times in the inputs are epoch seconds; the summary gives them relative to the traffic's start (t = 0).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.soak_probe import PROC_FIELDS, ROLES

FAULT_SLACK_S = 1.0  # a fault window is [fault start, recovery + this]
KILL_END_S = 1.0  # every request in flight at a core kill ends within this of the kill
RSS_GROWTH = 0.05  # after the baseline, at the pauses
FD_SLACK = 2  # "flat": fds and threads may differ by this much from the baseline pause
THREAD_SLACK = 2
TTFT_FACTOR = 1.5
WARMUP_S = 60.0  # a (re)started process's first minute: loading, first batches of each shape
MIN_LIFE_S = 120.0  # an incarnation is judged only over this much time after its warm-up
SUCCESS = ("ok", "cancelled")  # a cancel is the client's own doing
STREAMED = ("grpc", "chat_stream", "long", "cancel")  # kinds whose TTFT is measured


# ---- requests ----------------------------------------------------------------------------------------------


def read_events(path: Path) -> tuple[list[dict], list[dict]]:
    """(ended requests, hung ones: a begin with no end) from the Locust users' JSON lines."""
    begun: dict[int, dict] = {}
    ended: list[dict] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            if ev["ev"] == "begin":
                begun[ev["id"]] = ev
            else:
                begun.pop(ev["id"], None)
                ended.append(ev)
    return ended, list(begun.values())


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def window_stats(requests: list[dict], lo: float, hi: float) -> dict[str, Any]:
    """Requests that ended in (lo, hi]: counts by outcome and reason, TTFT and inter-token p50/p99 (seconds)."""
    inside = [r for r in requests if lo < r["t1"] <= hi]
    ttft = [r["ttft"] for r in inside if r["ttft"] is not None and r["kind"] in STREAMED]
    itl = [g for r in inside if r["kind"] in STREAMED for g in r["itl"]]
    reasons = Counter(f"{r['outcome']}: {r['reason']}" for r in inside if r["outcome"] not in SUCCESS)
    return {
        "requests": {o: sum(r["outcome"] == o for r in inside) for o in ("ok", "cancelled", "refused", "failed")},
        "reasons": dict(reasons),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
    }


# ---- faults ------------------------------------------------------------------------------------------------


def fault_windows(faults: list[dict]) -> list[tuple[float, float]]:
    """[start, recovery + 1 s] of each fault that makes errors expected (the unread stream is no excuse)."""
    return [(f["start"], f["window_end"]) for f in faults if f.get("window_end") is not None]


def in_windows(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in windows)


def overlaps(r: dict, windows: list[tuple[float, float]]) -> bool:
    return any(r["t0"] <= b and r["t1"] >= a for a, b in windows)


# ---- targets -----------------------------------------------------------------------------------------------


def _target(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "pass": bool(ok), "detail": detail}


def _pause_values(samples: list[dict], pick) -> list[tuple[float, Any]]:
    """(t, value) at each pause's end probe."""
    return [(s["t"], pick(s)) for s in samples if s.get("pause_probe") is not None]


def _proc(s: dict, role: str, field: str):
    p = s["procs"].get(role)
    return None if p is None else p[field]


def evaluate(run: dict[str, Any], requests: list[dict], hung: list[dict]) -> list[dict[str, Any]]:
    t0, baseline = run["t0"], run["schedule"]["baseline_s"]
    faults, samples = run["faults"], run["samples"]
    windows = fault_windows(faults)
    targets = []

    if run.get("locust_early_exit"):
        targets.append(_target("the load ran its course", False, "Locust exited early: see locust.log"))
    timeouts = [r for r in requests if r["reason"] == "timeout"]
    targets.append(
        _target(
            "0 requests hung",
            not hung and not timeouts,
            f"{len(hung)} never ended, {len(timeouts)} ended by the client's timeout, of {len(requests) + len(hung)}",
        )
    )

    errors = [r for r in requests if r["outcome"] not in SUCCESS]
    outside = [r for r in errors if not in_windows(r["t1"], windows)]
    targets.append(
        _target(
            "errors only inside fault windows",
            not outside,
            f"{len(errors)} errors, {len(outside)} outside"
            + "".join(f"; t={r['t1'] - t0:.1f} {r['kind']} {r['outcome']}: {r['reason']}" for r in outside[:5]),
        ),
    )

    late = []
    for f in (f for f in faults if f["kind"] == "core_kill"):
        hit = [r for r in requests if r["t0"] < f["start"] < r["t1"] and r["outcome"] not in SUCCESS]
        f["in_flight_errors"] = len(hit)
        f["in_flight_max_end_s"] = round(max((r["t1"] - f["start"] for r in hit), default=0.0), 3)
        late += [r for r in hit if r["t1"] - f["start"] > KILL_END_S]
    kills = [f for f in faults if f["kind"] == "core_kill"]
    targets.append(
        _target(
            f"in-flight requests end within {KILL_END_S:.0f} s of each core kill",
            (kills or not run["schedule"]["core_kills"]) and not late,  # none planned: nothing to miss
            f"{len(kills)} kills; requests in flight that errored: "
            + ", ".join(f"{f['in_flight_errors']} (last after {f['in_flight_max_end_s']} s)" for f in kills),
        )
    )

    stuck = [f for f in faults if f["kind"] in ("core_kill", "front_restart") and f.get("recovered") is None]
    targets.append(
        _target(
            "served again after every fault",
            not stuck,
            ", ".join(
                f"{f['kind']} at t={f['start'] - t0:.0f}: {_after(f)}" for f in faults if f["kind"] != "unread_stream"
            ),
        )
    )

    clear = [r for r in requests if not in_windows(r["t1"], windows)]
    bad = [r for r in clear if r["outcome"] not in SUCCESS]
    targets.append(
        _target("every request outside fault windows succeeded", not bad, f"{len(clear) - len(bad)} of {len(clear)}")
    )

    probes = [s for s in samples if s.get("pause_probe") is not None and s["t"] >= baseline]
    for field, label, check in (
        ("rss_mb", f"RSS grows <= {RSS_GROWTH:.0%} after the baseline", lambda a, b: b <= a * (1 + RSS_GROWTH)),
        ("fds", f"open fds flat (+{FD_SLACK})", lambda a, b: b <= a + FD_SLACK),
        ("threads", f"threads flat (+{THREAD_SLACK})", lambda a, b: b <= a + THREAD_SLACK),
    ):
        parts, ok = [], len(probes) >= 2
        for role in ROLES:
            values = [_proc(s, role, field) for s in probes]
            values = [v for v in values if v is not None]
            if len(values) < 2:
                parts.append(f"{role} n/a")
                ok = False
                continue
            good = all(check(values[0], v) for v in values[1:])
            ok &= good
            parts.append(f"{role} {values[0]:g} -> {values[-1]:g}" + ("" if good else " (!)"))
        targets.append(_target(label, ok, f"at {len(probes)} pauses: " + ", ".join(parts)))

    targets.append(restarted_processes_rss(samples))

    kv = _pause_values(samples, lambda s: s["engine"].get("kv_blocks_used"))
    targets.append(
        _target(
            "KV blocks in use back to 0 at every pause",
            kv and all(v == 0 for _, v in kv),
            ", ".join(f"t={t:.0f}: {v}" for t, v in kv),
        )
    )
    start_shm = samples[0]["shm_bytes"] if samples else None
    shm = _pause_values(samples, lambda s: s["shm_bytes"])
    # The Python backend's pool grows to the largest request it carried and never shrinks: whether it grew
    # further after the first pause tells a leak from that high-water mark.
    flat = bool(shm) and all(v is not None and v <= (shm[0][1] or 0) for _, v in shm)
    targets.append(
        _target(
            "/dev/shm back to its start at every pause",
            shm and start_shm is not None and all(v is not None and v <= start_shm for _, v in shm),
            f"start {_mb(start_shm)}; "
            + ", ".join(f"t={t:.0f}: {_mb(v)}" for t, v in shm)
            + f"; after the first pause {'flat' if flat else 'GREW'}",
        )
    )
    bound = run["engine_args"]["max_grammar_cache_bytes"]
    grammar = [s["engine"].get("grammar_cache_bytes") for s in samples]
    grammar = [g for g in grammar if g is not None]
    targets.append(
        _target(
            "grammar cache within its bound",
            grammar and max(grammar) <= bound,
            f"max {_mb(max(grammar, default=None))} of {_mb(bound)}",
        )
    )

    def ttfts(lo: float, hi: float) -> list[float]:
        return [
            r["ttft"]
            for r in requests
            if r["kind"] in STREAMED and r["ttft"] is not None and lo <= r["t0"] - t0 < hi and not overlaps(r, windows)
        ]

    base = percentile(ttfts(0, baseline), 99)
    after = percentile(ttfts(baseline, math.inf), 99)
    targets.append(
        _target(
            f"p99 TTFT outside fault windows <= {TTFT_FACTOR}x the baseline's",
            base is not None and after is not None and after <= TTFT_FACTOR * base,
            f"baseline (first {baseline:.0f} s) {_s(base)}, after {_s(after)}",
        )
    )

    missing = coverage_gaps(samples, windows)
    targets.append(
        _target(
            "every quantity sampled", not missing, "all present" if not missing else "missing: " + ", ".join(missing)
        )
    )
    targets.append(features_exercised(run, requests))
    return targets


def restarted_processes_rss(samples: list[dict]) -> dict[str, Any]:
    """The pauses compare a restarted process (the core after a kill, the front after its restart) with its
    predecessor; this follows each incarnation instead: its RSS from WARMUP_S after its first sample to its
    last, where it lived long enough to tell (under load: samples between pauses count too)."""
    parts, ok = [], True
    for role in ROLES:
        lives: dict[int, list[tuple[float, float]]] = {}
        for s in samples:
            p = s["procs"].get(role)
            if p is not None:
                lives.setdefault(p["pid"], []).append((s["t"], p["rss_mb"]))
        if len(lives) < 2:
            continue
        for pid, points in lives.items():
            warm = [(t, v) for t, v in points if t >= points[0][0] + WARMUP_S]
            if len(warm) < 2 or warm[-1][0] - warm[0][0] < MIN_LIFE_S:
                continue
            grew = warm[-1][1] / warm[0][1] - 1
            ok &= grew <= RSS_GROWTH
            parts.append(
                f"{role} {pid}: {warm[0][1]:.0f} -> {warm[-1][1]:.0f} MiB in {warm[-1][0] - warm[0][0]:.0f} s"
                + ("" if grew <= RSS_GROWTH else f" (+{grew:.0%})")
            )
    detail = ", ".join(parts) or "no restarted process lived long enough"
    return _target(
        f"RSS of each restarted process's incarnation grows <= {RSS_GROWTH:.0%} after its first minute", ok, detail
    )


def coverage_gaps(samples: list[dict], windows: list[tuple[float, float]]) -> list[str]:
    """Quantities absent from every sample, or from a sample outside the fault windows."""
    quiet = [s for s in samples if not in_windows(s["wall"], windows)]
    checks = {f"{role}.{field}": (lambda s, r=role, f=field: _proc(s, r, f)) for role in ROLES for field in PROC_FIELDS}
    checks |= {k: (lambda s, k=k: s["engine"].get(k)) for k in ("kv_blocks_used", "grammar_cache_bytes")}
    checks["shm_bytes"] = lambda s: s["shm_bytes"]
    checks |= {k: (lambda s, k=k: s["window"][k]) for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")}
    missing = []
    for name, pick in checks.items():
        if name.startswith(("ttft", "itl")):  # a window with no streamed request ended (a pause) has none
            present = [pick(s) for s in quiet if s.get("pause_probe") is None and s["t"] > 0]
            if not any(v is not None for v in present):
                missing.append(name)
            continue
        if not samples or all(pick(s) is None for s in samples) or any(pick(s) is None for s in quiet):
            missing.append(name)
    return missing


def features_exercised(run: dict[str, Any], requests: list[dict]) -> dict[str, Any]:
    """The features the mix is meant to combine each showed up: preemptions, prefix-cache hits, accepted drafts,
    structured outputs, cancels, hostile requests."""
    first, last = run["samples"][0]["engine"], run["samples"][-1]["engine"]

    def grew(key: str) -> float:
        return (last.get(key) or 0) - (first.get(key) or 0)

    kinds = Counter(r["kind"] for r in requests if r["outcome"] in SUCCESS)
    seen = {
        "preemptions": grew("preemptions"),
        "prefix_cache_hit_tokens": grew("prefix_cache_hits"),
        "accepted_draft_tokens": grew("spec_accepted_tokens"),
        "structured": kinds["structured"],
        "cancelled": sum(r["outcome"] == "cancelled" for r in requests),
        "hostile": kinds["hostile"],
    }
    return _target(
        "features exercised", all(v > 0 for v in seen.values()), ", ".join(f"{k} {v:g}" for k, v in seen.items())
    )


def _after(fault: dict) -> str:
    rec = fault.get("recovered")
    return "never" if rec is None else f"after {rec - fault['start']:.1f} s"


def _mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f} MiB"


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f} s"


# ---- summary -----------------------------------------------------------------------------------------------


def summarize(run: dict[str, Any], events_path: Path) -> dict[str, Any]:
    requests, hung = read_events(events_path)
    t0 = run["t0"]
    targets = evaluate(run, requests, hung)
    totals = window_stats(requests, -math.inf, math.inf)
    by_kind = {
        k: Counter(r["outcome"] for r in requests if r["kind"] == k) for k in sorted({r["kind"] for r in requests})
    }

    def rel(x: float | None) -> float | None:
        return None if x is None else round(x - t0, 2)

    faults = [
        dict(
            f,
            start=rel(f["start"]),
            recovered=rel(f.get("recovered")),
            window_end=rel(f.get("window_end")),
            end=rel(f.get("end")),
        )
        for f in run["faults"]
    ]
    return {
        "passed": all(t["pass"] for t in targets),
        "targets": targets,
        "requests": {"total": len(requests) + len(hung), "hung": len(hung), **totals, "by_kind": by_kind},
        "faults": faults,
        "pauses": [[rel(a), rel(b)] for a, b in run["pauses"]],
        "schedule": run["schedule"],
        "engine_args": run["engine_args"],
        "samples": run["samples"],
        "hung_requests": hung[:20],
    }


def print_targets(summary: dict[str, Any]) -> None:
    for t in summary["targets"]:
        print(f"{'PASS' if t['pass'] else 'MISS'}  {t['name']}: {t['detail']}")


# ---- the figure --------------------------------------------------------------------------------------------


def plot(summary: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    samples = summary["samples"]
    t = [s["t"] / 60 for s in samples]
    panels = [
        ("RSS (MiB)", {role: [_proc(s, role, "rss_mb") for s in samples] for role in ROLES}),
        ("open fds", {role: [_proc(s, role, "fds") for s in samples] for role in ROLES}),
        ("threads", {role: [_proc(s, role, "threads") for s in samples] for role in ROLES}),
        (
            "KV blocks",
            {
                "in use": [s["engine"].get("kv_blocks_used") for s in samples],
                "cached (free)": [s["engine"].get("kv_blocks_cached") for s in samples],
            },
        ),
        ("grammar cache (MiB)", {"cached": [_div(s["engine"].get("grammar_cache_bytes")) for s in samples]}),
        ("/dev/shm regions (MiB)", {"server's": [_div(s["shm_bytes"]) for s in samples]}),
        (
            "requests per 10 s window",
            {o: [s["window"]["requests"][o] for s in samples] for o in ("ok", "cancelled", "refused", "failed")},
        ),
        (
            "TTFT (s)",
            {"p50": [s["window"]["ttft_p50_s"] for s in samples], "p99": [s["window"]["ttft_p99_s"] for s in samples]},
        ),
        (
            "inter-token latency (ms)",
            {
                "p50": [_ms(s["window"]["itl_p50_s"]) for s in samples],
                "p99": [_ms(s["window"]["itl_p99_s"]) for s in samples],
            },
        ),
    ]
    fig, axes = plt.subplots(3, 3, figsize=(15, 9.5), sharex=True)
    colors = {"core_kill": "tab:red", "front_restart": "tab:orange"}
    for ax, (title, series) in zip(axes.flat, panels):
        for label, values in series.items():
            pts = [(x, v) for x, v in zip(t, values) if v is not None]
            if pts:
                ax.plot(*zip(*pts), lw=1.1, marker=".", ms=3, label=label)
        for f in summary["faults"]:
            if f["kind"] in colors and f["start"] is not None:
                end = f["window_end"] if f["window_end"] is not None else f["start"] + 1
                ax.axvspan(f["start"] / 60, end / 60, color=colors[f["kind"]], alpha=0.25, lw=0)
        for a, b in summary["pauses"]:
            ax.axvspan(a / 60, b / 60, color="tab:gray", alpha=0.15, lw=0)
        ax.axvline(summary["schedule"]["baseline_s"] / 60, color="k", ls=":", lw=0.8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    for ax in axes[-1]:
        ax.set_xlabel("minutes since the traffic started")
    fig.suptitle(
        "Soak: red = core killed, orange = OpenAI front restarted (to recovery + 1 s), gray = traffic "
        "paused, dotted = end of the baseline",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _div(b: float | None) -> float | None:
    return None if b is None else b / 2**20


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000
