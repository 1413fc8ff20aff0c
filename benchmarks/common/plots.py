"""The benchmark's pictures: throughput bars, occupancy and KV blocks over time, TTFT / latency CDFs."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common.metrics import RunResult  # noqa: E402

DPI = 90
SIZE = (7.0, 3.6)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def throughput_bars(rates: dict[str, float], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    names = list(rates)
    colors = ["tab:gray" if n.startswith(("hf", "vllm")) else "tab:blue" for n in names]
    bars = ax.bar(range(len(names)), list(rates.values()), color=colors)
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput on one trace (higher is better)")
    return _save(fig, path)


def _step_series(run: RunResult, value) -> tuple[np.ndarray, np.ndarray]:
    t = np.array([0.0] + [s.t for s in run.steps])
    v = np.array([value(run.steps[0])] + [value(s) for s in run.steps])
    return t, v


def occupancy_over_time(runs: list[RunResult], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    for run in runs:
        t, v = _step_series(run, lambda s, r=run: s.num_running / r.max_num_seqs)
        ax.step(t, 100 * v, where="post", label=run.name, lw=1.2)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("batch slots busy (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Occupancy: static waits for stragglers, continuous refills every step")
    ax.legend(fontsize=8)
    return _save(fig, path)


KV_TITLE = "KV cache: paged holds what is used, max_length reserves the worst case"


def kv_blocks_over_time(runs: list[RunResult], path: Path, title: str = KV_TITLE) -> Path:
    """Blocks in use (solid) and, where the prefix cache keeps any, free blocks holding cached prefixes (dotted)."""
    fig, ax = plt.subplots(figsize=SIZE)
    for run in runs:
        t, v = _step_series(run, lambda s: s.num_kv_blocks_used)
        peak_seqs = max(s.num_running for s in run.steps)
        (line,) = ax.step(t, v, where="post", label=f"{run.name} in use (peak {int(v.max())}, {peak_seqs} seqs)")
        t, c = _step_series(run, lambda s: s.num_kv_blocks_cached)
        if c.any():
            ax.step(t, c, where="post", ls=":", color=line.get_color(), label=f"{run.name} cached, free")
    total = runs[0].num_kv_blocks_total
    if total:
        ax.axhline(total, color="k", ls="--", lw=0.8, label=f"KV budget ({total} blocks)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("KV blocks")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def latency_cdfs(runs: list[RunResult], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(SIZE[0] * 1.4, SIZE[1]))
    panels = ((axes[0], "ttft_s", "time to first token (s)"), (axes[1], "latency_s", "request latency (s)"))
    for ax, attr, label in panels:
        for run in runs:
            x = np.sort(np.asarray(getattr(run, attr)))
            if len(x):
                ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=run.name, lw=1.2)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle("TTFT and latency CDFs (left is better), measured from arrival")
    return _save(fig, path)


def write_all(runs: dict[str, RunResult], out_dir: Path, extra_rates: dict[str, float] | None = None) -> list[Path]:
    """Every plot the data allows; the named runs are the benchmark's (absent ones are skipped).
    `extra_rates`: throughput of runs measured elsewhere (vLLM in its own environment)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    listed = [r for r in runs.values() if "@" not in r.name]  # the overhead run stops early: no comparable rate
    rates = {r.name: r.tokens_per_s for r in listed} | (extra_rates or {})
    paths = [throughput_bars(rates, out_dir / "throughput.png")]
    occ = [runs[n] for n in ("static+paged", "continuous+paged") if n in runs and runs[n].steps]
    if occ:
        paths.append(occupancy_over_time(occ, out_dir / "occupancy.png"))
    kv = [runs[n] for n in ("continuous+paged", "continuous+max_length") if n in runs and runs[n].steps]
    if kv:
        paths.append(kv_blocks_over_time(kv, out_dir / "kv_blocks.png"))
    paths.append(latency_cdfs(listed, out_dir / "latency_cdf.png"))
    return paths


def peer_bars(rows: list[dict], path: Path) -> Path:
    """inflight next to vLLM-CPU per model and dtype: throughput (left) and the ratio against each row's target
    (right). Each group's label says how much CPU other processes took during each side's run."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(SIZE[0] * 1.7, SIZE[1] * 1.25))
    x = np.arange(len(rows))
    labels = [
        f"{r['model']}\n{r['dtype']}\nothers {_share(r['inflight'].get('contention'))} / "
        f"{_share((r['vllm'] or {}).get('contention'))}"
        for r in rows
    ]
    width = 0.38
    ours = left.bar(x - width / 2, [r["inflight"]["tokens_per_s"] for r in rows], width, label="inflight")
    left.bar_label(ours, fmt="%.0f", fontsize=8)
    theirs = [r["vllm"]["tokens_per_s"] if r["vllm"] else 0.0 for r in rows]
    peer = left.bar(x + width / 2, theirs, width, color="tab:gray", label="vLLM-CPU")
    left.bar_label(peer, labels=[f"{v:.0f}" if r["vllm"] else "skipped" for v, r in zip(theirs, rows)], fontsize=8)
    left.set_ylabel("output tokens / s")
    left.set_title("Throughput, same trace (higher is better)")
    left.legend(fontsize=8)

    ratios = [r["inflight_over_vllm"] for r in rows]
    colors = [{True: "tab:green", False: "tab:red", None: "tab:gray"}[r["met"]] for r in rows]
    bars = right.bar(x, [v or 0.0 for v in ratios], 0.6, color=colors)
    right.bar_label(bars, labels=["n/a" if v is None else f"{v:.2f}×" for v in ratios], fontsize=8)
    targets = [r["target"] for r in rows]
    for i, t in enumerate(targets):
        right.hlines(t, i - 0.4, i + 0.4, color="k", ls="--", lw=1.0, label="target" if i == 0 else None)
    right.axhline(1.0, color="tab:gray", ls=":", lw=1.0, label="parity")
    right.set_ylim(0, max([*targets, *(v for v in ratios if v)]) * 1.2)
    right.set_ylabel("inflight ÷ vLLM-CPU")
    right.set_title("inflight ÷ vLLM-CPU (green: target met)")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xticks(x, labels, fontsize=8)
        # A group or two keep the width their bars have in a full chart, centred.
        ax.set_xlim((len(rows) - 1) / 2 - max(len(rows), 3) / 2, (len(rows) - 1) / 2 + max(len(rows), 3) / 2)
    fig.text(
        0.01, 0.01, "others: CPU share other processes took during the inflight run / vLLM's timed generate", fontsize=7
    )
    return _save(fig, path)


def _share(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def spec_decode_rounds(rows: list[dict], targets: dict[str, float], path: Path) -> Path:
    """Speculative decoding per cell: each round's paired speedup (dots), the median (bar), the target (tick)."""
    cells = [f"{r['trace']}@{r['in_flight']}" for r in rows]
    methods = [m for m in rows[0] if isinstance(rows[0][m], dict) and "speedups" in rows[0][m]]
    fig, ax = plt.subplots(figsize=SIZE)
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        xs = np.arange(len(rows)) + (j - (len(methods) - 1) / 2) * width
        medians = [r[method]["speedup"] for r in rows]
        ax.bar(xs, medians, width * 0.9, label=f"{method} (median)", alpha=0.6)
        for x, r in zip(xs, rows):
            ax.scatter([x] * len(r[method]["speedups"]), r[method]["speedups"], s=10, color="black", zorder=3)
    for i, cell in enumerate(cells):
        if cell in targets:
            ax.hlines(targets[cell], i - 0.45, i + 0.45, colors="tab:red", linestyles="--")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(cells)), cells)
    ax.set_ylabel("speedup over speculation off")
    ax.set_title("Speculative decoding: each round's paired ratio, median, target (red)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def cost_per_token_bars(result: dict, path: Path) -> Path:
    """CPU ms per output token by concurrency: in-process (grey) beside each served path, stacked by process,
    with served ÷ in-process over each served bar."""
    rows = result["rows"]
    levels = sorted({r["concurrency"] for r in rows})
    paths = list(dict.fromkeys(r["path"] for r in rows))
    parts = list(dict.fromkeys(k for r in rows for k in r["by_process_cpu_ms_per_token"]))
    colors = dict(zip(parts, plt.get_cmap("tab10").colors))
    width = 0.8 / (1 + len(paths))
    fig, ax = plt.subplots(figsize=(SIZE[0] * 1.3, SIZE[1] * 1.2))
    for i, c in enumerate(levels):
        cell = {r["path"]: r for r in rows if r["concurrency"] == c}
        base = next(iter(cell.values()))["in_process_cpu_ms_per_token"]
        ax.bar(i - 0.4 + width / 2, base, width, color="tab:gray", label="in-process" if i == 0 else None)
        for j, name in enumerate(paths):
            if name not in cell:
                continue
            x, bottom = i - 0.4 + width * (j + 1.5), 0.0
            for part, value in cell[name]["by_process_cpu_ms_per_token"].items():
                ax.bar(x, value, width, bottom=bottom, color=colors[part], label=part if i == 0 and j == 0 else None)
                bottom += value
            ax.text(x, bottom, f"{name}\n{cell[name]['ratio']:.2f}×", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(levels)), [f"{c} in flight" for c in levels])
    ax.set_ylabel("CPU ms per output token")
    ax.set_title("Server-side CPU per token, served ÷ in-process over each bar (lower is better)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    return _save(fig, path)
