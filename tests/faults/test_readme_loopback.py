"""The README's loopback head (``ray start --head ...`` for ``ray job submit`` on one machine) really
listens on 127.0.0.1 only: the command is read from the README, started with its own temp dir and
free ports, every listening TCP socket of every process of that Ray is checked, and those
processes (found by a marker in their environment or their files under the temp dir; never
``ray stop``, which would stop every Ray on the machine) are killed."""

import shutil
import subprocess
import tempfile
import time
import uuid

import psutil

from tests.faults.conftest import processes_of, readme_loopback_head, stop_marked

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _listening(procs) -> dict:
    out = {}
    for p in procs:
        try:
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out[(c.laddr.ip, c.laddr.port)] = " ".join(p.cmdline())[:120]
        except psutil.Error:
            pass
    return out


def test_readme_loopback_head_listens_on_loopback_only():
    temp_dir = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # short: Ray's socket paths have a length limit
    marker = uuid.uuid4().hex
    argv, env, _ports = readme_loopback_head(temp_dir, marker)
    try:
        started = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-3000:]
        seen: dict = {}
        # the agents and the dashboard open their ports after `ray start` returns (later on a loaded machine):
        # sample until at least 5 listening sockets were seen, then a few rounds more
        until, extra_rounds = time.time() + 180.0, 6
        while time.time() < until and extra_rounds > 0:
            seen.update(_listening(processes_of(marker, temp_dir)))
            extra_rounds -= len(seen) >= 5
            time.sleep(0.5)
        # GCS, raylet, the dashboard and its agents listen: fewer means the sampling saw too little to prove anything
        assert len(seen) >= 5, seen
        exposed = {addr: cmd for addr, cmd in seen.items() if addr[0] not in LOOPBACK}
        assert exposed == {}, f"the README's loopback head listens beyond loopback: {exposed}"
    finally:
        for p in processes_of(marker, temp_dir):  # found by its files only: not marked
            try:
                p.kill()
            except psutil.Error:
                pass
        stop_marked(marker)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert processes_of(marker, temp_dir) == []
