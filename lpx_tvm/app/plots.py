"""Figures (the optional ``plot`` extra, matplotlib): a profile's roofline and a sweep's Pareto fronts."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install \"lpx-tvm[plot]\"") from None
    return plt


def roofline(report: dict, path) -> Path:
    """Each layer's achieved FLOP/s against its arithmetic intensity (FLOPs per SRAM/host byte), under the
    chip's matrix peak and its SRAM-bandwidth roof.

    Parameters
    ----------
    report : dict
        What :func:`lpx_tvm.app.profile.profile` returns.
    path : str or Path
        The image to write (its extension picks the format).
    """
    plt = _pyplot()
    chip = report["chip"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [(row["flops"] / max(row["bytes"], 1), row["flops"] / row["seconds"], row["bound"])
              for row in report["layers"] if row["flops"] and row["seconds"] > 0 and row["bytes"]]
    for bound in sorted({b for _, _, b in points}):
        xs = [x for x, _, b in points if b == bound]
        ys = [y for _, y, b in points if b == bound]
        ax.scatter(xs, ys, s=14, label=f"{bound}-bound layers")
    if points:
        lo = min(x for x, _, _ in points) / 2
        hi = max(x for x, _, _ in points) * 2
        peak, bandwidth = chip["peak_flops"], chip["sram_bytes_per_s"]
        knee = peak / bandwidth
        xs = [lo, max(lo, min(knee, hi)), hi]
        ax.plot(xs, [min(peak, bandwidth * x) for x in xs], "k-", lw=1, label="roofline (matrix peak, SRAM bandwidth)")
    ax.set_yscale("log")
    return _save(plt, fig, ax, path, "arithmetic intensity (FLOPs per byte moved)", "achieved FLOP/s",
                 f"{report.get('model', 'model')} on {chip['name']} ({report.get('dtype', '')})")


def _save(plt, fig, ax, path, xlabel: str, ylabel: str, title: str) -> Path:
    """A log-x panel labelled, titled and written to ``path``."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)
    return Path(path)


def pareto(records: list, path, cost: str = "area_mm2", value: str = "latency_us") -> Path:
    """One panel per (model, dtype): every chip variant's ``value`` against its ``cost``, the front joined."""
    plt = _pyplot()
    groups = {}
    for record in records:
        if record.get("ok"):
            groups.setdefault((record["model"], record["dtype"]), []).append(record)
    if not groups:
        raise ValueError("no successful points to plot")
    cols = min(len(groups), 3)
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, ((model, dtype), group) in zip(axes.flat, sorted(groups.items())):
        ax.scatter([r[cost] for r in group], [r[value] for r in group], s=16, color="tab:gray")
        front = sorted((r for r in group if r.get("pareto")), key=lambda r: r[cost])
        ax.plot([r[cost] for r in front], [r[value] for r in front], "o-", color="tab:red", ms=4, label="Pareto front")
        for r in front:
            ax.annotate(r["variant"].split("[", 1)[-1].rstrip("]") or r["variant"], (r[cost], r[value]),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{model} {dtype}", fontsize=9)
        ax.set_xlabel("die area proxy, mm² (assumed split)" if cost == "area_mm2" else cost, fontsize=8)
        ax.set_ylabel(value.replace("_us", " µs"), fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)
    return Path(path)


def plan_frontier(report: dict, path) -> Path:
    """Tokens/s per user against tokens/s per chip for every mapping and batch size planned, the frontier
    joined and the chosen mapping marked."""
    from .plan import frontier

    plt = _pyplot()
    rows = report["frontier"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for batch in sorted({r["batch"] for r in rows}):
        group = [r for r in rows if r["batch"] == batch]
        ax.scatter([r["tokens_per_s_per_chip"] for r in group], [r["tokens_per_s_per_user"] for r in group], s=18,
                   label=f"batch {batch}")
    front = sorted(frontier(rows), key=lambda r: r["tokens_per_s_per_chip"])
    ax.plot([r["tokens_per_s_per_chip"] for r in front], [r["tokens_per_s_per_user"] for r in front], "k--", lw=1,
            label="frontier")
    ax.scatter([report["tokens_per_s_per_chip"]], [report["tokens_per_s_per_user"]], s=80, facecolors="none",
               edgecolors="red", label=f"chosen: {report['chips']} chips")
    return _save(plt, fig, ax, path, "tokens/s per chip", "tokens/s per user",
                 f"{report['model']} on {report['system']} ({report['dtype']})")
