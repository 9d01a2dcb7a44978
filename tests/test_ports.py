import socket

from loadtests.ports import free_port


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    lo, _hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # random, so concurrent starters rarely pick the same one
    for port in ports:
        assert 10000 <= port < lo  # Ray's worker ports end at 19999; ephemeral binds start at `lo`
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_stop_server_kills_a_server_that_ignores_sigterm():
    import subprocess
    import sys

    from loadtests.ports import stop_server

    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"  # the handler is in place
    stop_server(proc, timeout_s=0.5)
    assert proc.returncode == -9
    gentle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop_server(gentle, timeout_s=10)
    assert gentle.returncode == -15
