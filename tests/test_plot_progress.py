"""The BLEU-progress trend: the fit recovers a known log-linear curve, and the plot is written."""

import json
import math

import pytest

from model.training.plot_progress import hours_to, log_fit, plot


def test_log_fit_recovers_a_known_curve_and_inverts_it():
    hours = [1.0, 2.5, 6.0, 11.0]
    a, b = log_fit(hours, [3.0 + 5.0 * math.log(h) for h in hours])
    assert a == pytest.approx(3.0) and b == pytest.approx(5.0)
    assert hours_to(3.0 + 5.0 * math.log(40.0), a, b) == pytest.approx(40.0)
    assert hours_to(30.0, 10.0, 0.0) == math.inf  # a flat trend never reaches the goal


def test_plot_writes_the_figure_and_reports_hours_to_goal(tmp_path):
    pts = [{"hours": h, "zh2en": 2 + 6 * math.log(h), "en2zh": 1 + 8 * math.log(h)} for h in (2, 4, 8, 12)]
    for p in pts[1:]:  # a second test set scored from the second export on: its own panel
        p["ted_zh2en"], p["ted_en2zh"] = -4 + 5 * math.log(p["hours"]), 7.0
    data = tmp_path / "progress.json"
    data.write_text(json.dumps({"goals": {"zh2en": 30, "en2zh": 25, "ted_zh2en": 10, "ted_en2zh": 9},
                                "points": pts}))
    summary = plot(data, tmp_path / "p.png")
    assert summary["ted_zh2en"]["hours_to_goal"] == pytest.approx(math.exp(14 / 5), abs=0.05)
    assert summary["ted_en2zh"]["hours_to_goal"] == math.inf  # flat: never
    assert (tmp_path / "p.png").stat().st_size > 10_000
    assert summary["zh2en"]["hours_to_goal"] == pytest.approx(math.exp(28 / 6), rel=1e-3)
    assert summary["en2zh"]["hours_to_goal"] == pytest.approx(math.exp(3), rel=1e-3)
