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
