"""The benchmark's pictures: throughput bars, occupancy and KV blocks over time, TTFT / latency CDFs."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.metrics import RunResult  # noqa: E402

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
