"""The sweep's figures (matplotlib, PNG): α vs γ, speedup vs γ over the analytical curves,
per-position acceptance, and where the time goes."""

from __future__ import annotations

from pathlib import Path

from specdec.bench.analysis import CellRow


def draw_all(rows: list[CellRow], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    directory.mkdir(parents=True, exist_ok=True)
    spec = [r for r in rows if r.engine == "specdec" and r.alpha is not None and r.schedule == "fixed"]
    if not spec:
        return []
    paths = [alpha_vs_gamma(spec, directory / "alpha_vs_gamma.png"),
             speedup_vs_gamma(spec, directory / "speedup_vs_gamma.png"),
             per_position(spec, directory / "per_position_acceptance.png"),
             time_split(rows, directory / "time_split.png")]
    if any(r.schedule == "adaptive" for r in rows):
        paths.append(schedules(rows, directory / "schedules.png"))
    return paths


def schedules(rows: list[CellRow], path: Path) -> Path:
    """Modeled speedup per cell: the best fixed γ (plain included), the adaptive controller, HF's heuristic."""
    import matplotlib.pyplot as plt

    methods = sorted({r.method for r in rows if r.schedule == "adaptive"})
    figure, axes = plt.subplots(len(methods), 1, figsize=(12, 3.2 * len(methods)), squeeze=False)
    for ax, method in zip(axes[:, 0], methods):
        cells = sorted({(r.dataset, r.temperature) for r in rows if r.method == method and r.schedule == "adaptive"})
        def value(schedule: str, cell: tuple[str, float]) -> float:
            found = [r.modeled_speedup for r in rows if r.method == method and r.schedule == schedule
                     and (r.dataset, r.temperature) == cell and r.modeled_speedup is not None]
            return max([1.0, *found]) if schedule == "fixed" else (found[0] if found else 0.0)
        x = range(len(cells))
        for offset, (schedule, label) in enumerate([("fixed", "best fixed γ (or plain)"), ("adaptive", "adaptive"),
                                                    ("heuristic", "HF heuristic")]):
            ax.bar([i + (offset - 1) * 0.27 for i in x], [value(schedule, c) for c in cells], width=0.27, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(x), [f"{d}\nT={t:g}" for d, t in cells], fontsize=7)
        ax.set_ylabel(f"{method}\nmodeled speedup")
        ax.legend(fontsize=7, ncol=3)
    figure.suptitle("modeled speedup over plain decoding (step counts × measured cost curves)", fontsize=10)
    figure.tight_layout()
    return _save(figure, path)


def _grid(rows: list[CellRow], title: str):
    import matplotlib.pyplot as plt

    methods = sorted({r.method for r in rows})
    temperatures = sorted({r.temperature for r in rows})
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(len(methods), len(temperatures), figsize=(max(7, 5 * len(temperatures)), 3.4 * len(methods)),
                                squeeze=False, sharex=True)
    figure.suptitle(title, fontsize=10)
    for i, method in enumerate(methods):
        for j, temperature in enumerate(temperatures):
            axes[i][j].set_title(f"{method}, temperature {temperature:g}", fontsize=10)
            axes[i][j].grid(alpha=0.3)
            axes[i][j].xaxis.set_major_locator(MaxNLocator(integer=True))
            yield axes[i][j], [r for r in rows if r.method == method and r.temperature == temperature]
    figure.tight_layout()


def _save(figure, path: Path) -> Path:
    figure.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path


def _by_dataset(rows: list[CellRow]) -> dict[str, list[CellRow]]:
    out: dict[str, list[CellRow]] = {}
    for r in sorted(rows, key=lambda r: r.gamma):
        out.setdefault(r.dataset, []).append(r)
    return out


def alpha_vs_gamma(rows: list[CellRow], path: Path) -> Path:
    import matplotlib.pyplot as plt

    for ax, cell_rows in _grid(rows, "acceptance α by γ"):
        for dataset, series in _by_dataset(cell_rows).items():
            ax.plot([r.gamma for r in series], [r.alpha for r in series], "o-", label=dataset)
        _rate_axes(ax, "γ", "α")
    return _save(plt.gcf(), path)


def _rate_axes(ax, xlabel: str, ylabel: str) -> None:
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def speedup_vs_gamma(rows: list[CellRow], path: Path) -> Path:
    import matplotlib.pyplot as plt

    for ax, cell_rows in _grid(rows, "speedup vs γ: measured (o, solid), seeds' formula (x, dashed), cost-aware (+, dotted)"):
        for index, (dataset, series) in enumerate(_by_dataset(cell_rows).items()):
            color = f"C{index}"
            gammas = [r.gamma for r in series]
            ax.plot(gammas, [r.speedup or 0 for r in series], "o-", color=color, label=dataset)
            ax.plot(gammas, [r.predicted_seeds for r in series], "x--", color=color, alpha=0.7)
            ax.plot(gammas, [r.predicted_cost_aware for r in series], "+:", color=color, alpha=0.9)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xlabel("γ")
        ax.set_ylabel("speedup over plain")
        ax.legend(fontsize=7)
    return _save(plt.gcf(), path)


def per_position(rows: list[CellRow], path: Path) -> Path:
    """Acceptance at each draft position, for each method's largest γ."""
    import matplotlib.pyplot as plt

    largest = {}
    for r in rows:
        key = (r.method, r.temperature, r.dataset)
        if key not in largest or r.gamma > largest[key].gamma:
            largest[key] = r
    for ax, cell_rows in _grid(list(largest.values()), "acceptance per draft position (largest γ)"):
        for dataset, series in _by_dataset(cell_rows).items():
            r = series[-1]
            ax.plot(range(1, len(r.per_position) + 1), r.per_position, "o-", label=f"{dataset} (γ={r.gamma})")
        _rate_axes(ax, "draft position", "P(accepted | drafted)")
    return _save(plt.gcf(), path)


def time_split(rows: list[CellRow], path: Path) -> Path:
    """ms per generated token split into drafting, verification and the rest, mean over datasets."""
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r.engine == "specdec"]
    temperatures = sorted({r.temperature for r in mine})
    labels = sorted({r.label for r in mine}, key=lambda label: (label != "specdec none", label))
    figure, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 0.4 * len(labels) + 1.5),
                                squeeze=False, sharey=True)
    for ax, temperature in zip(axes[0], temperatures):
        left = [0.0] * len(labels)
        for part, color in (("draft", "C1"), ("verify", "C0"), ("other", "C7")):
            widths = []
            for label in labels:
                cells = [r for r in mine if r.label == label and r.temperature == temperature]
                if part == "other" and all(not r.time_split_s for r in cells):  # plain decoding: all one part
                    widths.append(sum(1000 / r.tok_per_s[0] for r in cells) / len(cells) if cells else 0)
                else:
                    widths.append(sum(r.time_split_s.get(part, 0) * 1000 for r in cells) / len(cells) if cells else 0)
            ax.barh(labels, widths, left=left, color=color, label=part)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_title(f"temperature {temperature:g}", fontsize=10)
        ax.set_xlabel("ms per generated token (mean over datasets)")
        ax.legend(fontsize=7)
    figure.tight_layout()
    return _save(figure, path)
