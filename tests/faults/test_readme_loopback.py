"""The README's loopback head (``ray start --head ...`` for ``ray job submit`` on one machine) really
listens on 127.0.0.1 only: the command is read from the README, started with its own temp dir and
free ports, every listening TCP socket of every process of that Ray is checked, and those
processes (found by a marker in their environment or their files under the temp dir; never
``ray stop``, which would stop every Ray on the machine) are killed."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from tests.faults.conftest import MARK_ENV, REPO, alive, marked_pids
from verl_lite.utils.net import free_port

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
PORT_FLAGS = ("--port", "--dashboard-port")
EXTRA_FREE_PORTS = ("--dashboard-agent-listen-port", "--ray-client-server-port", "--metrics-export-port")


def _readme_head_command() -> list[str]:
    """The README's loopback ``ray start --head`` command (continuation lines joined), as argv."""
    text = (REPO / "README.md").read_text()
    match = re.search(r"^(\S+=\S+ )*ray start --head --node-ip-address=127\.0\.0\.1(?:.*\\\n)*.*$", text, re.M)
    assert match, "the README has no loopback `ray start --head --node-ip-address=127.0.0.1` command"
    return shlex.split(match.group(0).replace("\\\n", " "))


def _processes(marker: str, temp_dir: str) -> list[psutil.Process]:
    found = set(marked_pids(marker))
    for p in psutil.process_iter(["cmdline"]):
        try:
            if temp_dir in " ".join(p.info["cmdline"] or []) or any(
                    f.path.startswith(temp_dir + "/") for f in p.open_files()):
                found.add(p.pid)
        except psutil.Error:
            continue
    return [psutil.Process(pid) for pid in alive(found)]


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
    argv = _readme_head_command()
    env = dict(os.environ)
    while "=" in argv[0]:
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    assert argv[0] == "ray"
    argv[0] = str(Path(sys.executable).parent / "ray")
    for flag in PORT_FLAGS:
        argv = [f"{flag}={free_port()}" if a.startswith(f"{flag}=") else a for a in argv]
    temp_dir = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # short: Ray's socket paths have a length limit
    argv += [f"{flag}={free_port()}" for flag in EXTRA_FREE_PORTS] + [f"--temp-dir={temp_dir}"]
    marker = uuid.uuid4().hex
    env[MARK_ENV] = marker
    env.pop("RAY_ADDRESS", None)
    try:
        started = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-3000:]
        seen: dict = {}
        # the agents and the dashboard open their ports after `ray start` returns (later on a loaded machine):
        # sample until at least 5 listening sockets were seen, then a few rounds more
        until, extra_rounds = time.time() + 180.0, 6
        while time.time() < until and extra_rounds > 0:
            seen.update(_listening(_processes(marker, temp_dir)))
            extra_rounds -= len(seen) >= 5
            time.sleep(0.5)
        # GCS, raylet, the dashboard and its agents listen: fewer means the sampling saw too little to prove anything
        assert len(seen) >= 5, seen
        exposed = {addr: cmd for addr, cmd in seen.items() if addr[0] not in LOOPBACK}
        assert exposed == {}, f"the README's loopback head listens beyond loopback: {exposed}"
    finally:
        for _ in range(20):
            procs = _processes(marker, temp_dir)
            if not procs:
                break
            for p in procs:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(procs, timeout=3.0)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert _processes(marker, temp_dir) == []
