"""``gpo.plot`` on synthetic CSVLogger files: the PNG is written, the newest run is found, errors say what is wrong."""

import csv
import os

import pytest

from gpo.plot import find_metrics_csv, moving_average, plot_run, read_metrics

COLUMNS = ["epoch", "step", "reward", "reward/mean", "completion/len_mean", "completion/len_max", "val/reward/mean"]


def write_metrics(path, steps=20, val_every=5):
    """Rows as CSVLogger writes them: one per logging call, empty cells for what that call did not log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        for step in range(steps):
            reward = step / steps
            lengths = {"completion/len_mean": 3.5, "completion/len_max": 4}
            writer.writerow({"epoch": 0, "step": step, "reward": reward, "reward/mean": reward, **lengths})
            if step % val_every == val_every - 1:
                writer.writerow({"epoch": 0, "step": step, "val/reward/mean": reward})
    return path


def test_read_metrics_skips_empty_cells(tmp_path):
    series = read_metrics(write_metrics(tmp_path / "metrics.csv"))
    assert len(series["reward/mean"][0]) == 20
    assert list(series["val/reward/mean"][0]) == [4, 9, 14, 19]


def test_plot_run_writes_a_png(tmp_path):
    out = plot_run(write_metrics(tmp_path / "run/lightning_logs/version_0/metrics.csv"), tmp_path / "c.png", None, 5)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_run_one_requested_metric(tmp_path):
    out = plot_run(write_metrics(tmp_path / "metrics.csv"), tmp_path / "sub/c.png", ["completion/len_max"], 1)
    assert out.stat().st_size > 0


def test_missing_metric_lists_the_available_columns(tmp_path):
    with pytest.raises(ValueError, match=r"reward/nope missing.*available: .*completion/len_mean"):
        plot_run(write_metrics(tmp_path / "metrics.csv"), tmp_path / "c.png", ["reward/nope"], 5)


def test_find_metrics_csv_picks_the_newest_version(tmp_path):
    root = tmp_path / "run"
    for age, version in enumerate([2, 10, 1]):  # version_1 written last
        path = write_metrics(root / f"lightning_logs/version_{version}/metrics.csv")
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    newest = root / "lightning_logs/version_1/metrics.csv"
    assert find_metrics_csv(root) == find_metrics_csv(root / "lightning_logs") == newest
    assert find_metrics_csv(root / "lightning_logs/version_10") == root / "lightning_logs/version_10/metrics.csv"
    assert find_metrics_csv(newest) == newest


def test_a_newer_validation_only_run_is_passed_over_for_the_run_that_trained(tmp_path, capsys):
    """``gpo validate`` after training writes a newer version holding only ``val/`` columns; the curves a user asks
    for are the training run's."""
    from gpo.cli import main

    root = tmp_path / "run"
    trained = write_metrics(root / "lightning_logs/version_0/metrics.csv")
    validated = root / "lightning_logs/version_1/metrics.csv"
    validated.parent.mkdir()
    validated.write_text("epoch,step,val/reward_greedy\n0,0,0.5\n")
    os.utime(trained, (1_000_000, 1_000_000))
    assert find_metrics_csv(root) == trained and find_metrics_csv(validated) == validated
    main(["plot", str(root)])
    assert f"read {trained} (1 validation-only left out)" in capsys.readouterr().out
    trained.unlink()
    assert find_metrics_csv(root) == validated  # nothing trained: the newest run all the same


def test_no_metrics_csv_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no metrics.csv found: .*empty has no metrics.csv, \*/metrics.csv"):
        find_metrics_csv((tmp_path / "empty").mkdir() or tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_metrics_csv(tmp_path / "nowhere")


def test_moving_average_is_a_trailing_mean():
    import numpy as np

    assert moving_average(np.array([0.0, 2.0, 4.0, 6.0]), 2).tolist() == [0.0, 1.0, 3.0, 5.0]
    assert moving_average(np.array([1.0, 3.0]), 1).tolist() == [1.0, 3.0]
