"""The training clock leaves out the gaps in which the run did not run (model/training/run_clock.py)."""

from model.training.run_clock import RunClock


class Fake:
    def __init__(self):
        self.wall, self.cpu = 1000.0, 5.0

    def advance(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu


def clock(start: float = 0.0):
    f = Fake()
    return f, RunClock(start, wall=lambda: f.wall, cpu=lambda: f.cpu)


def test_busy_time_counts_from_the_resumed_total():
    f, c = clock(start=3600.0)
    for _ in range(10):
        f.advance(wall=0.8, cpu=1.5)  # a step on two threads
        assert c.tick() == 0.0
    assert abs(c.seconds - 3608.0) < 1e-9


def test_a_stopped_process_does_not_count():
    f, c = clock()
    f.advance(wall=0.8, cpu=1.5)
    c.tick()
    f.advance(wall=720.0, cpu=0.2)  # SIGSTOP for 12 minutes inside one step
    assert c.tick() == 720.0
    f.advance(wall=0.8, cpu=1.5)
    c.tick()
    assert abs(c.seconds - 1.6) < 1e-9


def test_long_gaps_with_work_count():
    f, c = clock()
    f.advance(wall=90.0, cpu=150.0)  # an in-training evaluation
    assert c.tick() == 0.0
    f.advance(wall=30.0, cpu=0.0)  # short gaps always count, busy or not
    assert c.tick() == 0.0
    assert c.seconds == 120.0
