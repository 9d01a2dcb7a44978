"""The training-log plot: loss and dev BLEU against hours, and a clear error for a log with nothing to plot."""

import json

import pytest

from model.training.plot_log import plot


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_writes_loss_and_bleu(tmp_path):
    log = tmp_path / "train.log"
    _write(log, [{"event": "start", "params": 10}, {"step": 20, "loss": 5.0, "hours": 0.1},
                 {"step": 40, "loss": 4.0, "hours": 0.2}, {"step": 40, "event": "eval", "bleu_zh2en": 3.5},
                 {"step": 50, "event": "eval", "ted_dev_bleu_en2zh": 1.0}])  # step 50: placed at the nearest line
    out = plot(log, tmp_path / "out" / "curve.png")
    assert out.is_file() and out.stat().st_size > 0


def test_a_log_with_evaluations_but_no_training_lines_is_named(tmp_path):
    log = tmp_path / "train.log"
    _write(log, [{"event": "start", "params": 10}, {"step": 5, "event": "eval", "bleu_zh2en": 0.1}])
    with pytest.raises(ValueError, match="no training lines"):
        plot(log, tmp_path / "curve.png")


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path):
    log = tmp_path / "train.log"
    # a run killed mid-line, then resumed: its first line is appended to the torn one
    log.write_text('{"step": 20, "loss": 5.0, "hours": 0.1}\n{"step": 40, "lo{"event": "resumed", "step": 20}\n'
                   '{"step": 40, "loss": 4.0, "hours": 0.2}\n\n')
    assert plot(log, tmp_path / "curve.png").is_file()
