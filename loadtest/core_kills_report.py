"""core_kills' report: per-kill rows summed up, the checks that fail the run, a table and a plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

SPEC_ERROR_S = 1.0  # every in-flight request gets its error within this
STUB_SLACK = 4  # fds or threads the stub may gain over the whole run (a leak grows with every kill)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ends = [t for r in rows for t in r["time_to_end_s"]]
    back = [r["served_again_s"] for r in rows if r["served_again_s"] is not None]
    core = [r["core_back_s"] for r in rows if r["core_back_s"] is not None]

    def stats(xs: list[float]) -> dict[str, float | None]:
        return {"p50": round(statistics.median(xs), 4) if xs else None, "max": round(max(xs), 4) if xs else None}

    return {
        "kills": len(rows),
        "requests_in_flight": sum(r["in_flight"] for r in rows),
        "hung": sum(r["hung"] for r in rows),
        "over_spec": sum(r["over_spec"] for r in rows),
        "ended_with_death_error": sum(r["ended_with_death_error"] for r in rows),
        "ended_with_other_error": sum(r["ended_with_other_error"] for r in rows),
        "completed": sum(r["completed"] for r in rows),
        "not_served_again": sum(r["served_again_s"] is None for r in rows),
        "model_unready_during_restart": sum(not r["ready_throughout"] for r in rows),
        "time_to_end_s": stats(ends),
        "core_back_s": stats(core),
        "served_again_s": stats(back),
    }


def failures(result: dict[str, Any], kills: int) -> list[str]:
    s, f = result["summary"], result["final"]
    found = []
    if s["kills"] < kills:
        found.append(f"only {s['kills']} of {kills} kills ran")
    if s["hung"]:
        found.append(f"{s['hung']} request(s) hung")
    if s["not_served_again"]:
        found.append("the server did not serve again after a kill")
    if s["ended_with_other_error"]:
        found.append(f"{s['ended_with_other_error']} in-flight request(s) ended with another error than the death's")
    if not f.get("load_stopped", False):
        found.append("a client was still waiting after the load stopped")
    if not f.get("serves"):
        found.append("the server does not serve after the kills")
    if f.get("kv_blocks_used") != 0 or f.get("requests_running") != 0 or f.get("requests_waiting") != 0:
        found.append("the engine is not empty after the load: " + ", ".join(
            f"{k}={f.get(k)}" for k in ("kv_blocks_used", "requests_running", "requests_waiting")))  # fmt: skip
    if f.get("core_starts") != f.get("core_starts_expected"):
        found.append(f"{f.get('core_starts')} core starts, expected {f.get('core_starts_expected')}")
    cores = f.get("core_processes", {})
    live = [int(pid) for pid, state in cores.items() if state not in ("Z", "X")]
    if live != [f.get("core_pid")] or len(cores) != 1:
        found.append(f"core processes left {cores} (the metrics name {f.get('core_pid')})")
    before, after = f.get("stub_before", {}), f.get("stub_after", {})
    for what in ("fds", "threads"):
        if what in before and what in after and after[what] > before[what] + STUB_SLACK:
            found.append(f"the stub's {what} grew from {before[what]} to {after[what]}")
    if f.get("cores_after_stop"):
        found.append(f"core processes outlived the server: {f['cores_after_stop']}")
    return found


# ---- the report ------------------------------------------------------------------------------------------


def _s(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def row_line(row: dict[str, Any]) -> str:
    return (
        f"{row['in_flight']} in flight ({row['mid_stream']} mid-stream), hung {row['hung']}, ended after "
        f"p50 {_s(row['time_to_end_p50_s'], 3)} / max {_s(row['time_to_end_max_s'], 3)} s; core back "
        f"{_s(row['core_back_s'])} s, served again {_s(row['served_again_s'])} s"
        + ("" if row["ready_throughout"] else "; model not ready for a while")
    )


def table(result: dict[str, Any]) -> str:
    lines = [
        "| kill | in flight | hung | > 1 s | time to error p50 / max (s) | core back (s) | served again (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(result["kills"], 1):
        lines.append(
            f"| {i} | {r['in_flight']} | {r['hung']} | {r['over_spec']} | {_s(r['time_to_end_p50_s'], 3)} / "
            f"{_s(r['time_to_end_max_s'], 3)} | {_s(r['core_back_s'])} | {_s(r['served_again_s'])} |"
        )
    s = result["summary"]
    lines.append(
        f"| **all {s['kills']}** | {s['requests_in_flight']} | **{s['hung']}** | {s['over_spec']} | "
        f"{_s(s['time_to_end_s']['p50'], 3)} / {_s(s['time_to_end_s']['max'], 3)} | "
        f"{_s(s['core_back_s']['p50'])} / {_s(s['core_back_s']['max'])} | "
        f"**{_s(s['served_again_s']['p50'])} / {_s(s['served_again_s']['max'])}** |"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = result["kills"]
    x = list(range(1, len(rows) + 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, r in zip(x, rows):
        left.scatter([i] * len(r["time_to_end_s"]), [1000 * t for t in r["time_to_end_s"]], s=12, color="tab:blue")
    left.plot(x, [1000 * (r["time_to_end_max_s"] or 0) for r in rows], color="tab:blue", lw=1, label="max")
    left.axhline(1000 * SPEC_ERROR_S, color="tab:red", ls="--", lw=1, label="bound (1 s)")
    left.set_yscale("log")
    left.set_xlabel("kill")
    left.set_ylabel("kill → request ended (ms)")
    left.set_title(f"In-flight requests: {result['summary']['hung']} hung")
    left.legend(fontsize=8)
    right.plot(x, [r["core_back_s"] for r in rows], marker="o", label="new core up")
    right.plot(x, [r["served_again_s"] for r in rows], marker="o", label="fresh request served")
    right.set_xlabel("kill")
    right.set_ylabel("seconds after the kill")
    right.set_ylim(bottom=0)
    right.set_title("Time until served again")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
