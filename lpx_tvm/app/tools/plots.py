"""Figures (the optional ``plot`` extra, matplotlib): a profile's roofline and timeline, a sweep's Pareto fronts
and a plan's frontier."""

from __future__ import annotations

from pathlib import Path

from ...runtime_sim.errors import LpxUserError


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        from ..models.trained import MissingExtraError

        raise MissingExtraError("plots need matplotlib: pip install \"lpx-tvm[plot]\"") from None
    return plt


def roofline(report: dict, path) -> Path:
    """Each layer's achieved FLOP/s against its arithmetic intensity (FLOPs per SRAM/host byte), under every
    ceiling a layer can be bound by: the matrix peak, the vector ALUs' peak (an ALU operation a cycle each),
    the SRAM bandwidth and the host link.

    Parameters
    ----------
    report : dict
        What :func:`lpx_tvm.app.tools.profile.profile` returns.
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
        xs = [lo, hi]
        ax.plot(xs, [chip["peak_flops"]] * 2, "k-", lw=1, label="matrix peak")
        if chip.get("vector_ops_per_s"):
            ax.plot(xs, [chip["vector_ops_per_s"]] * 2, "k--", lw=1, label="vector ALUs' peak")
        ax.plot(xs, [chip["sram_bytes_per_s"] * x for x in xs], "k:", lw=1, label="SRAM bandwidth × intensity")
        if chip.get("host_bytes_per_s"):
            ax.plot(xs, [chip["host_bytes_per_s"] * x for x in xs], "-.", color="gray", lw=1,
                    label="host link × intensity")
        ys = [y for _, y, _ in points]
        ax.set_ylim(min(ys) / 4, chip["peak_flops"] * 2)
    ax.set_yscale("log")
    return _save(plt, fig, ax, path, "arithmetic intensity (FLOPs per byte moved)", "achieved FLOP/s",
                 f"{report.get('model', 'model')} on {chip['name']} ({report.get('dtype', '')})")


def timeline(trace_path, path, width: float = 11.0) -> Path:
    """A trace-event file (``profile --trace``) drawn as a timeline: a row per track (a plane's array and its
    install port, a vector queue, a DMA engine, a link port), each slice a bar coloured by its kind.

    Parameters
    ----------
    trace_path : str or Path
        The JSON that :func:`lpx_tvm.runtime_sim.trace.write_trace` wrote.
    path : str or Path
        The image to write.
    """
    import json

    plt = _pyplot()
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M"
             and e["name"] in ("process_name", "thread_name")}
    slices = [e for e in events if e["ph"] == "X"]
    tracks = sorted({(e["pid"], e["tid"]) for e in slices})
    kinds = sorted({e["name"] for e in slices})
    colours = {k: plt.cm.tab20(i % 20) for i, k in enumerate(kinds)}
    fig, ax = plt.subplots(figsize=(width, 0.28 * len(tracks) + 1.6))
    rows = {track: row for row, track in enumerate(tracks)}
    bars = {}
    for e in slices:
        bars.setdefault((e["pid"], e["tid"], e["name"]), []).append((e["ts"], max(e["dur"], 1e-3)))
    for (pid, tid, kind), spans in bars.items():
        row = rows[(pid, tid)]
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=colours[kind], linewidth=0)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([f"{names.get((pid, None), pid)}: {names.get((pid, tid), tid)}" for pid, tid in tracks],
                       fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("µs")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in kinds]
    ax.legend(handles, kinds, fontsize=6, ncol=min(len(kinds), 8), loc="upper center",
              bbox_to_anchor=(0.5, -0.12 if len(tracks) > 8 else -0.25))
    ax.set_title(Path(trace_path).stem)
    fig.tight_layout()
    fig.savefig(str(path), dpi=130)
    plt.close(fig)
    return Path(path)


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
        raise LpxUserError("no successful points to plot")
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
    from ..plan.search import frontier

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
    for r in front:  # each frontier point: its mapping, batch and chips
        ax.annotate(f"{r['stages']}×{r['width']}, batch {r['batch']}, {r['chips']} chips",
                    (r["tokens_per_s_per_chip"], r["tokens_per_s_per_user"]), fontsize=7, xytext=(-6, -12),
                    textcoords="offset points", ha="right")
    ax.scatter([report["tokens_per_s_per_chip"]], [report["tokens_per_s_per_user"]], s=80, facecolors="none",
               edgecolors="red", label=f"chosen: {report['chips']} chips")
    return _save(plt, fig, ax, path, "tokens/s per chip", "tokens/s per user",
                 f"{report['model']} on {report['system']} ({report['dtype']})")
