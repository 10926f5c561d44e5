"""``free_port``: a listening port that no outgoing connection can take between the pick and the bind."""

import socket

from verl_lite.utils import net


def test_the_port_is_free_and_below_the_kernels_ephemeral_range():
    low = int(net.EPHEMERAL_RANGE_FILE.read_text().split()[0])
    ports = {net.free_port() for _ in range(50)}
    assert all(net.LISTEN_PORTS_FLOOR <= port < low for port in ports), sorted(ports)
    assert len(ports) > 40, "ports are drawn at random, not the same one each time"
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_bound_or_excluded_port_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # the draw range is [taken - 1, taken + 2): one excluded port, one bound port, one free port
        monkeypatch.setattr(net, "LISTEN_PORTS_FLOOR", taken - 1)
        monkeypatch.setattr(net, "_ephemeral_low", lambda: taken + 2)
        monkeypatch.setattr(net, "MIN_DRAW_RANGE", 3)
        for _ in range(20):
            assert net.free_port(exclude={taken - 1}) not in (taken - 1, taken)


def test_without_the_range_file_the_kernel_picks(monkeypatch, tmp_path):
    monkeypatch.setattr(net, "EPHEMERAL_RANGE_FILE", tmp_path / "absent")
    port = net.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
