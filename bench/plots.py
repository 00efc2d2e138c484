"""PNG plots and markdown tables from bench/results/*.json (written by bench/run.py):

    python bench/plots.py [--out docs/bench]

  ingest_grid.png        apply time vs batch size, one panel per table size, one line per engine
  ingest_wa.png          write amplification vs batch size (bytes written / bytes of changed rows)
  ingest_table_size.png  the 200k-change batch into 2M and 20M rows, per engine
The markdown tables it prints are the ones in docs/benchmarks-history.md ("Ingest: batch size x table size").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LABELS = {
    "ours-mor": "ours, merge-on-read",
    "ours-cow": "ours, copy-on-write",
    "pyiceberg": "pyiceberg upsert",
    "delta": "delta-rs merge",
    "rewrite": "DuckDB full rewrite",
}
STYLE = {
    "ours-mor": ("tab:blue", "o"),
    "ours-cow": ("tab:cyan", "s"),
    "pyiceberg": ("tab:purple", "D"),
    "delta": ("tab:orange", "^"),
    "rewrite": ("tab:gray", "v"),
}


def load_ingest() -> dict[tuple[int, int], dict[str, dict]]:
    """(rows, changes) -> engine -> result, verified runs only."""
    out: dict[tuple[int, int], dict[str, dict]] = {}
    for f in sorted(RESULTS.glob("ingest-*.json")):
        d = json.loads(f.read_text())
        out[(d["rows"], d["changes"])] = {r["engine"]: r for r in d["results"] if r.get("verified")}
    return out


def _fmt(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"


def markdown(data: dict) -> str:
    lines = [
        "| table rows | batch | engine | median s | first s | x ours-mor | WA | peak RSS MB |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (rows, changes), engines in sorted(data.items()):
        base = engines.get("ours-mor", {}).get("median_seconds")
        for name, label in LABELS.items():
            r = engines.get(name)
            if r is None:
                continue
            ratio = f"{r['median_seconds'] / base:.2f}" if base else "-"
            lines.append(
                f"| {_fmt(rows)} | {_fmt(changes)} | {label} | {r['median_seconds']:.2f} | "
                f"{r['first_seconds']:.2f} | {ratio} | {r['write_amplification']:.2f} | {r['peak_rss_mb']:,.0f} |"
            )
    return "\n".join(lines)


def plot(data: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    sizes = sorted({rows for rows, changes in data if changes != 200_000})
    panels = (
        [
            ("median_seconds", "ingest_grid.png", "apply time, s (median, warm)"),
            ("write_amplification", "ingest_wa.png", "write amplification"),
        ]
        if sizes
        else []
    )
    for metric, fname, ylabel in panels:
        fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), sharey=True, squeeze=False)
        for ax, rows in zip(axes[0], sizes):
            for name, label in LABELS.items():
                pts = sorted((c, e[name][metric]) for (r, c), e in data.items() if r == rows and name in e)
                if len(pts) < 2:
                    continue
                color, marker = STYLE[name]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=label)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"table of {_fmt(rows)} rows")
            ax.set_xlabel("changes in the batch")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        axes[0][0].legend(fontsize=8)
        fig.suptitle("Applying one batch of Notion-like changes (2 vCPU)", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(out / fname)
    fixed = sorted((r, e) for (r, c), e in data.items() if c == 200_000)
    if fixed:
        names = [n for n in LABELS if any(n in e for _, e in fixed)]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        width = 0.8 / len(fixed)
        for i, (rows, engines) in enumerate(fixed):
            xs = [j + i * width for j in range(len(names))]
            ys = [engines[n]["median_seconds"] if n in engines else 0 for n in names]
            ax.bar(xs, ys, width, label=f"{_fmt(rows)} rows")
            for x, y in zip(xs, ys):
                if y:
                    ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + width * (len(fixed) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels([LABELS[n] for n in names], fontsize=8, rotation=15)
        ax.set_yscale("log")
        ax.set_ylabel("apply time, s (median, warm)")
        ax.set_title("200k changes: how the cost grows with the table", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "ingest_table_size.png", dpi=110)
        plt.close(fig)
        written.append(out / "ingest_table_size.png")
    return written


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE.parent / "docs" / "bench"))
    a = p.parse_args()
    data = load_ingest()
    if not data:
        print(f"no results in {RESULTS}; run python bench/run.py first")
        return 1
    print(markdown(data))
    for f in plot(data, Path(a.out)):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
