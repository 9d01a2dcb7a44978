"""model/progress.py: a tqdm bar on a terminal, plain lines at a fixed interval off one, chosen by the
stream, an argument or $ATTNSERVE_PROGRESS."""

from __future__ import annotations

import io
import re

import pytest
from tqdm import tqdm

from model import progress as pg

LINE = re.compile(r"^work: (\d+)/10 \((\d+)%\) [\d.]+(?:step/s|s/step), elapsed \d\d:\d\d, ETA \d\d:\d\d(.*)$")


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(pg.MODE_ENV, raising=False)
    monkeypatch.delenv(pg.INTERVAL_ENV, raising=False)


def test_the_stream_an_argument_or_the_environment_choose_bar_or_lines(monkeypatch):
    assert isinstance(pg.progress(total=1, file=Tty()), tqdm)
    assert isinstance(pg.progress(total=1, file=io.StringIO()), pg.PlainProgress)
    assert isinstance(pg.progress(total=1, file=io.StringIO(), tty=True), tqdm)
    assert isinstance(pg.progress(total=1, file=Tty(), tty=False), pg.PlainProgress)
    monkeypatch.setenv(pg.MODE_ENV, "bar")
    assert isinstance(pg.progress(total=1, file=io.StringIO()), tqdm)
    monkeypatch.setenv(pg.MODE_ENV, "lines")
    assert isinstance(pg.progress(total=1, file=Tty()), pg.PlainProgress)
    assert isinstance(pg.progress(total=1, file=Tty(), tty=True), tqdm)  # the argument wins


def test_a_bar_redraws_in_place_with_rate_and_postfix():
    out = Tty()
    with pg.progress(total=10, desc="work", unit="step", file=out) as bar:
        for _ in range(10):
            bar.update(1)
            bar.set_postfix({"loss": 1.5})
    text = out.getvalue()
    assert "\r" in text and "%|" in text and "10/10" in text and "loss=1.5" in text
    assert re.search(r"(step/s|s/step)", text)


def test_lines_at_most_every_interval_plus_a_final_line(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(pg.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    with pg.progress(total=10, desc="work", unit="step", file=out, interval_s=5) as p:
        for _ in range(7):
            clock[0] += 2  # an update every 2 s: a line at 6 s (3 steps), then at 12 s (6 steps)
            p.update(1)
            p.set_postfix({"loss": 0.25, "tok/s": 1200})
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [LINE.match(line)[1] for line in lines] == ["3", "6", "7"]  # the last one from close()
    first = LINE.match(lines[0])
    assert first[2] == "30" and first[3] == ", loss=0.25, tok/s=1200"
    assert lines[0] == "work: 3/10 (30%) 2.00s/step, elapsed 00:06, ETA 00:14, loss=0.25, tok/s=1200"


def test_iterating_counts_items_and_a_final_line_is_not_repeated():
    out = io.StringIO()
    items = list(pg.progress(range(4), desc="work", unit="step", file=out, interval_s=0))
    assert items == [0, 1, 2, 3]
    assert [line.split(" ")[1] for line in out.getvalue().splitlines()] == ["1/4", "2/4", "3/4", "4/4"]


def test_unknown_totals_and_byte_counts(monkeypatch):
    monkeypatch.setenv(pg.INTERVAL_ENV, "1000")
    out = io.StringIO()
    with pg.progress(desc="download", unit="B", unit_scale=True, file=out) as p:
        p.update(3_500_000)
    (line,) = out.getvalue().splitlines()
    assert re.fullmatch(r"download: 3\.50MB [\d.]+[kMGTP]?B/s, elapsed 00:00", line), line


def test_write_line_lifts_a_bar_out_of_the_way(capsys):
    err = Tty()
    bar = pg.progress(total=3, desc="work", file=err)
    bar.update(1)
    pg.write_line('{"step": 1}')
    bar.close()
    assert capsys.readouterr().out == '{"step": 1}\n'
    assert err.getvalue().count("work:") >= 2  # drawn, cleared for the line, drawn again


def test_disabled_progress_iterates_silently(capsys):
    assert list(pg.progress(range(3), desc="quiet", disable=True)) == [0, 1, 2]
    assert capsys.readouterr() == ("", "")
