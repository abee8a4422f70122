"""PNG plots of serving runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_distributions(runs: list[dict[str, Any]], out: Path, title: str) -> Path:
    """TTFT and ITL histograms and CDFs, one series per request rate.
    runs: [{"label": str, "samples": {"ttft_ms": [...], "itl_ms": [...]}}]"""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for row, key, name in ((0, "ttft_ms", "time to first token (ms)"), (1, "itl_ms", "inter-token latency (ms)")):
        series = [(run["label"], np.sort(np.asarray(run["samples"][key], dtype=float))) for run in runs]
        series = [(label, v) for label, v in series if v.size]
        if not series:
            continue
        every = np.concatenate([v for _, v in series])
        lo, hi = max(float(every.min()), 1e-3), max(float(every.max()), 1e-3)
        # Shared bins, so the rates compare; logarithmic when a tail spans decades (stalls).
        wide = hi / lo > 20
        bins = np.geomspace(lo, hi, 41) if wide else np.histogram_bin_edges(every, bins=40)
        for label, values in series:
            axes[row][0].hist(values, bins=bins, histtype="step", linewidth=1.5, label=label)
            axes[row][1].plot(values, np.arange(1, values.size + 1) / values.size, label=label)
        axes[row][0].set(xlabel=name, ylabel="count", title=f"{name.split(' (')[0]}: histogram")
        axes[row][1].set(xlabel=name, ylabel="fraction <= x", title=f"{name.split(' (')[0]}: CDF")
        for ax in axes[row]:
            if wide:
                ax.set_xscale("log")
            ax.grid(alpha=0.3)
            ax.legend(title="request rate", fontsize=8)
    return _save(plt, fig, title, out)


def rate_sweep(runs: list[dict[str, Any]], out: Path, title: str) -> Path:
    """Throughput and latency (mean and p99) against request rate.
    runs: [{"label": str, "metrics": summarize_run(...)}], in sweep order."""
    plt = _pyplot()
    labels = [r["label"] for r in runs]
    x = np.arange(len(runs))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    m = [r["metrics"] for r in runs]
    axes[0].plot(x, [v["output_tps"] for v in m], "o-", label="output tok/s")
    axes[0].plot(x, [v["total_tps"] for v in m], "s-", label="total tok/s")
    ax2 = axes[0].twinx()
    ax2.plot(x, [v["request_throughput"] for v in m], "^--", color="gray", label="req/s")
    ax2.set_ylabel("requests / s")
    axes[0].set(ylabel="tokens / s", title="throughput")
    axes[0].legend(loc="upper left", fontsize=8)
    for ax, key, name in ((axes[1], "ttft_ms", "TTFT"), (axes[2], "tpot_ms", "TPOT")):
        for stat, style in (("mean", "o-"), ("p99", "s--")):
            ax.plot(x, [v[key][stat] if v[key][stat] is not None else np.nan for v in m], style, label=f"{name} {stat}")
        if key == "ttft_ms":
            ax.plot(x, [v["e2e_ms"]["mean"] if v["e2e_ms"]["mean"] is not None else np.nan for v in m], "^:",
                    label="E2E mean")
        ax.set(ylabel="ms", title=f"{name} against request rate")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    return _save(plt, fig, title, out)


def _save(plt: Any, fig: Any, title: str, out: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
