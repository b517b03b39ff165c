"""Reward and completion-length curves of a run, from the ``metrics.csv`` that Lightning's CSVLogger writes."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np

LENGTH_METRICS = ("completion/len_mean", "completion/len_max")
SEARCHED = ("metrics.csv", "*/metrics.csv", "*/*/metrics.csv")  # a version folder, lightning_logs, the root dir


def metrics_csv_candidates(path: str | Path) -> list[Path]:
    """Every ``metrics.csv`` at most two folders below ``path``, oldest first (by time written, then version)."""
    path = Path(path)
    if path.is_file():
        return [path]
    found = {csv_path for pattern in SEARCHED for csv_path in path.glob(pattern)}
    return sorted(found, key=lambda p: (p.stat().st_mtime, _version(p.parent.name), str(p)))


def trained(metrics_csv: Path) -> bool:
    """Whether the run logged training steps (a ``reward/`` column), not only a validation (``gpo validate``)."""
    with open(metrics_csv, newline="") as file:
        header = next(csv.reader(file), [])
    return any(column.startswith("reward/") for column in header)


def find_metrics_csv(path: str | Path) -> Path:
    """The run's ``metrics.csv``: ``path`` itself, its version folder's, or the newest version's below it that
    trained (a ``gpo validate`` afterwards writes a newer version holding only its validation), else the newest."""
    candidates = metrics_csv_candidates(path)
    if not candidates:
        where = "does not exist" if not Path(path).exists() else "has no " + ", ".join(SEARCHED)
        deeper = sorted({str(p.parents[2]) for p in Path(path).glob("*/*/*/metrics.csv")})
        runs = f"; it holds the runs {', '.join(deeper)}: give one of them" if deeper else ""
        raise FileNotFoundError(
            f"no metrics.csv found: {path} {where}{runs} (CSVLogger writes "
            "<trainer.default_root_dir>/lightning_logs/version_N/metrics.csv once a step has been logged, "
            "every trainer.log_every_n_steps)"
        )
    return ([c for c in candidates if trained(c)] or candidates)[-1]


def read_metrics(metrics_csv: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{column: (steps, values)}`` over the rows where the column has a value (CSVLogger leaves the rest empty)."""
    with open(metrics_csv, newline="") as file:
        rows = list(csv.DictReader(file))
    columns = [c for c in (rows[0].keys() if rows else []) if c not in ("step", "epoch")]
    series = {}
    for column in columns:
        points = np.array([(row["step"], row[column]) for row in rows if row.get(column) not in (None, "")], float)
        series[column] = (points[:, 0], points[:, 1]) if len(points) else (np.array([]), np.array([]))
    return series


def default_metrics(columns: list[str]) -> list[str]:
    """``reward/mean``, each ``reward/<fn>``, ``val/...reward...`` columns and the completion lengths present."""
    rewards = [c for c in columns if c.startswith("reward/") and c != "reward/std"]
    rewards.sort(key=lambda c: c != "reward/mean")
    val = sorted(c for c in columns if c.startswith("val/") and "reward" in c)
    return rewards + val + [c for c in LENGTH_METRICS if c in columns]


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` points (fewer at the start); ``window <= 1`` returns ``values``."""
    if window <= 1 or len(values) == 0:
        return values
    sums = np.cumsum(np.insert(values, 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def plot_run(metrics_csv: Path, out: Path, metrics: list[str] | None = None, window: int = 5) -> Path:
    """Plot ``metrics`` (default: rewards, then completion lengths) against ``step`` into the PNG ``out``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = read_metrics(Path(metrics_csv))
    wanted = metrics or default_metrics(list(series))
    missing = [m for m in wanted if m not in series or len(series[m][0]) == 0]
    if missing or not wanted:
        what = f"metric column(s) {', '.join(missing)} missing or empty" if missing else "no reward or length columns"
        raise ValueError(f"{what} in {metrics_csv}; available: {', '.join(sorted(series)) or 'none'}")
    panels = [
        ("reward", [m for m in wanted if not m.startswith("completion/")]),
        ("completion length (tokens)", [m for m in wanted if m.startswith("completion/")]),
    ]
    panels = [(label, names) for label, names in panels if names]
    fig = Figure(figsize=(9, 3.2 * len(panels) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (label, names) in zip(axes, panels, strict=True):
        for name, shown_as in _fold_duplicates(names, series).items():
            _draw(ax, shown_as, *series[name], window)
        ax.set_ylabel(label)
        if label.startswith("completion"):
            top = max(float(series[name][1].max()) for name in names)  # a count: from zero, so a flat length
            ax.set_ylim(0, 1.15 * top if top > 0 else 1)  # does not look like a swing
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("step")
    smoothing = f"lines: trailing mean of {window} logged points; dots: raw" if window > 1 else "raw values"
    fig.suptitle(f"{run_name(Path(metrics_csv))}  ({smoothing})")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def _fold_duplicates(names: list[str], series: dict) -> dict[str, str]:
    """``{column: legend label}``; a column equal to one drawn earlier (one reward function = the mean) joins its
    label instead of hiding under it."""
    labels: dict[str, str] = {}
    for name in names:
        same = next((k for k in labels if _equal(series[k], series[name])), None)
        if same is None:
            labels[name] = name
        else:
            labels[same] += f" = {name}"
    return labels


def _equal(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return a[0].shape == b[0].shape and bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))


def _draw(ax, name: str, steps: np.ndarray, values: np.ndarray, window: int) -> None:
    if name.startswith("val/"):  # sparse evaluation points: draw them as they are
        ax.plot(steps, values, "o-", ms=4, label=name)
        return
    style = "--" if name.split(" = ")[0].endswith("_max") else "-"  # a maximum above its mean, not hiding it
    (line,) = ax.plot(steps, moving_average(values, window), style, lw=1.8, label=name)
    if window > 1:
        ax.plot(steps, values, ".", ms=4, alpha=0.35, color=line.get_color())


def run_name(metrics_csv: Path) -> str:
    """``root/lightning_logs/version_3/metrics.csv`` -> ``root/version_3`` (the folder name a person recognises)."""
    version = metrics_csv.parent
    root = version.parent.parent if version.parent.name == "lightning_logs" else version.parent
    return f"{root.name}/{version.name}" if root.name else version.name


def _version(name: str) -> int:
    match = re.fullmatch(r"version_(\d+)", name)
    return int(match.group(1)) if match else -1
