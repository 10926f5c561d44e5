"""Shared pieces of the fault matrix: broken files built from the e2e tiny assets, a CLI runner that
tags every process of a run with a marker, and the checks that no process of the run is left."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import tiny_assets, tiny_overrides  # noqa: F401  (fixture re-exported)
from verl_lite.utils.net import free_port
from verl_lite.utils.processes import kill_and_wait

REPO = Path(__file__).resolve().parents[2]
MARK_ENV = "VERL_LITE_FAULT_RUN"


def write_parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _row(content="1+2=", ground_truth="3", **extra):
    row = {"data_source": "synthetic/addition", "prompt": [{"role": "user", "content": content}],
           "reward_model": {"ground_truth": ground_truth, "style": "rule"}}
    row.update(extra)
    return row


@pytest.fixture(scope="session")
def bad_files(tiny_assets, tmp_path_factory):  # noqa: F811
    """Paths of broken data files, a broken model dir and reward files that fail in every way."""
    root = tmp_path_factory.mktemp("faults")
    f: dict[str, str] = {}
    f["no_column"] = write_parquet(root / "no_column.parquet",
                                   [{"data_source": "s", "question": "1+1", "reward_model": {"ground_truth": "2"}}])
    (root / "corrupt.parquet").write_bytes(b"PAR1 this is not a parquet file at all")
    f["corrupt"] = str(root / "corrupt.parquet")
    f["string_prompt"] = write_parquet(root / "string_prompt.parquet",
                                       [{**_row(), "prompt": "   "}])
    f["no_truth"] = write_parquet(root / "no_truth.parquet", [{**_row(), "reward_model": {"style": "rule"}}])
    f["empty_prompt"] = write_parquet(root / "empty_prompt.parquet", [_row(), _row(content="   ")])
    f["bad_message"] = write_parquet(root / "bad_message.parquet", [{**_row(), "prompt": [{"role": "user"}]}])
    f["bad_source"] = write_parquet(root / "bad_source.parquet", [{**_row(), "data_source": 7}])
    f["empty_file"] = str(root / "empty.parquet")
    (root / "empty.parquet").write_bytes(b"")
    broken = root / "broken_model"
    shutil.copytree(tiny_assets["model"], broken)
    (broken / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 32,')  # truncated JSON
    f["broken_model"] = str(broken)
    partial = root / "partial_model"
    shutil.copytree(tiny_assets["model"], partial)
    cfg = json.loads((partial / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (partial / "config.json").write_text(json.dumps(cfg))
    f["partial_model"] = str(partial)
    short = root / "short_context_model"
    shutil.copytree(tiny_assets["model"], short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (short / "config.json").write_text(json.dumps(cfg))
    f["short_context_model"] = str(short)
    rewards = {
        "import_error": "import this_module_does_not_exist\n\ndef compute_score(**kw):\n    return 0.0\n",
        "syntax_error": "def compute_score(data_source, solution_str:\n    return 1\n",
        "raises_at_import": "raise RuntimeError('the grader needs a licence server')\n",
        "other_name": "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
        "no_kwargs": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
        "positional": "def compute_score(solution, truth):\n    return 0.0\n",
        "not_callable": "compute_score = 3\n",
    }
    for name, src in rewards.items():
        (root / f"reward_{name}.py").write_text(src)
        f[f"reward_{name}"] = str(root / f"reward_{name}.py")
    (root / "recipe_bad.yaml").write_text("data:\n  train_batch_size: -3\n")
    f["recipe_bad"] = str(root / "recipe_bad.yaml")
    (root / "rows.jsonl").write_text('{"prompt": [{"role": "user", "content": "1+1="}]}\n')
    f["jsonl"] = str(root / "rows.jsonl")
    (root / "shards").mkdir()
    f["a_dir"] = str(root / "shards")
    (root / "a_file").write_text("not a directory")
    f["a_file"] = str(root / "a_file")
    ro = root / "read_only"
    ro.mkdir()
    ro.chmod(0o555)
    f["read_only"] = str(ro)
    return f


# ---------------------------------------------------------------- processes of a run


def marked_pids(marker: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries ``MARK_ENV=marker``: every process of that run."""
    needle = f"{MARK_ENV}={marker}".encode()
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            with open(f"/proc/{p.pid}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return found


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


README_HEAD = re.compile(r"^(\S+=\S+ )*ray start --head --node-ip-address=127\.0\.0\.1(?:.*\\\n)*.*$", re.M)
HEAD_PORT_FLAGS = ("--port", "--dashboard-port")  # the README's fixed ports, replaced by free ones
HEAD_EXTRA_PORT_FLAGS = ("--dashboard-agent-listen-port", "--ray-client-server-port", "--metrics-export-port")


def readme_loopback_head(temp_dir: str, marker: str, base_env: dict | None = None) -> tuple[list[str], dict, dict]:
    """The README's loopback ``ray start --head`` command as it is written there (continuation lines joined):
    its variables go into the environment, ``ray`` is this venv's, every port it fixes and Ray's other fixed
    default ports are free ones (another Ray on this machine, the suite's own, cannot collide), ``--temp-dir``
    is ``temp_dir`` and ``MARK_ENV=marker`` marks every process of that Ray (``stop_marked``). Returns
    (argv, env, {flag: port}); ``env`` is ``base_env`` (default: this process's) without ``RAY_ADDRESS``, plus those."""
    match = README_HEAD.search((REPO / "README.md").read_text())
    assert match, "the README has no loopback `ray start --head --node-ip-address=127.0.0.1` command"
    argv = shlex.split(match.group(0).replace("\\\n", " "))
    env = {k: v for k, v in (os.environ if base_env is None else base_env).items() if k != "RAY_ADDRESS"}
    while "=" in argv[0]:
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    assert argv[0] == "ray", argv
    argv[0] = str(Path(sys.executable).parent / "ray")
    ports = {flag: free_port() for flag in HEAD_PORT_FLAGS + HEAD_EXTRA_PORT_FLAGS}
    argv = [a for a in argv if not a.startswith(tuple(f"{flag}=" for flag in ports))]
    argv += [f"{flag}={port}" for flag, port in ports.items()] + [f"--temp-dir={temp_dir}"]
    env[MARK_ENV] = marker
    return argv, env, ports


def stop_marked(marker: str, rounds: int = 20) -> list[int]:
    """SIGKILL every process marked with ``marker`` and every descendant of one (never ``ray stop``: it would stop
    every Ray on the machine), again while new ones appear; returns those still alive after ``rounds`` rounds.
    Descendants are taken before anything is killed: Ray's agents retitle themselves (``ray::DashboardAgent``),
    which overwrites the environment /proc shows, so the marker cannot find them once their raylet is gone."""
    for _ in range(rounds):
        procs = {}
        for pid in marked_pids(marker):
            try:
                root = psutil.Process(pid)
                procs.update({p.pid: p for p in [root, *root.children(recursive=True)]})
            except psutil.Error:
                pass
        if not procs:
            return []
        kill_and_wait(list(procs.values()), timeout_s=3.0)
    return marked_pids(marker)


def processes_of(marker: str, temp_dir: str) -> list[psutil.Process]:
    """Live processes marked with ``marker`` or whose command line or open files name ``temp_dir``."""
    found = set(marked_pids(marker))
    for p in psutil.process_iter(["cmdline"]):
        try:
            if temp_dir in " ".join(p.info["cmdline"] or []) or any(
                    f.path.startswith(temp_dir + "/") for f in p.open_files()):
                found.add(p.pid)
        except psutil.Error:
            continue
    return [psutil.Process(pid) for pid in alive(found)]


class CliRun:
    """``python -m verl_lite.trainer.main_ppo ARGS`` in a subprocess; records the pids of its process tree
    while it runs (every 0.2 s) and, when asked, the listening TCP sockets of those processes."""

    def __init__(self, args: list[str], env: dict | None = None, watch_sockets: bool = False):
        self.marker = uuid.uuid4().hex
        full_env = dict(os.environ, **(env or {}), **{MARK_ENV: self.marker})
        full_env.pop("RAY_ADDRESS", None)
        full_env.setdefault("OMP_NUM_THREADS", "1")
        self.started = time.time()
        self.proc = subprocess.Popen([sys.executable, "-m", "verl_lite.trainer.main_ppo", *args], cwd=REPO,
                                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pids: set[int] = {self.proc.pid}
        self.cmdlines: dict[int, str] = {}
        self.listening: dict[tuple, int] = {}  # (ip, port) -> pid
        self.watch_sockets = watch_sockets
        self._done = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._done.is_set():
            try:
                procs = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                procs = []
            for p in procs:
                self.pids.add(p.pid)
                try:  # read at every poll, the last non-empty one kept: a child seen between fork and exec
                    cmdline = " ".join(p.cmdline())  # still shows its parent's, a zombie shows ""
                    if cmdline:
                        self.cmdlines[p.pid] = cmdline
                except psutil.Error:
                    pass
                if self.watch_sockets:
                    try:
                        for c in p.net_connections(kind="tcp"):
                            if c.status == psutil.CONN_LISTEN:
                                self.listening[(c.laddr.ip, c.laddr.port)] = p.pid
                    except psutil.Error:
                        pass
            self._done.wait(0.2)

    def wait(self, timeout: float) -> "CliRun":
        try:
            self.out, self.err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            holders = sorted(set(alive(self.pids)) | set(marked_pids(self.marker)))
            named = [(pid, self.cmdlines.get(pid, "")[:100]) for pid in holders]
            for pid in holders:
                try:
                    psutil.Process(pid).kill()
                except psutil.Error:
                    pass
            self.out, self.err = self.proc.communicate()
            raise AssertionError(f"the run did not end within {timeout}s (exit {self.proc.returncode}; its processes "
                                 f"still alive: {named}); stderr tail:\n{self.err[-3000:]}")
        finally:
            self.ended = time.time()
            self._done.set()
            self._poller.join()
        self.code = self.proc.returncode
        return self

    def leftover(self, settle_s: float = 10.0) -> list:
        """Processes of the run still alive ``settle_s`` after it exited (by its pids and by its marker)."""
        deadline = time.time() + settle_s
        while True:
            left = sorted(set(alive(self.pids - {self.proc.pid})) | set(marked_pids(self.marker)))
            if not left or time.time() > deadline:
                return [(pid, " ".join(psutil.Process(pid).cmdline())[:80]) for pid in alive(left)]
            time.sleep(0.3)


def wait_for_run(predicate, run: "CliRun", timeout: float, what: str):
    """Poll ``predicate`` until it returns a truthy value (returned), failing if the run exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if run.proc.poll() is not None:
            run.wait(5)
            raise AssertionError(f"the run exited ({run.code}) before {what}:\n{run.err[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout}s")


def check_clean_exit(run: "CliRun", code: int, pattern: str) -> None:
    """Exit ``code``, ``pattern`` in stderr, no traceback, no process of the run left."""
    assert run.code == code, f"exit {run.code}, expected {code}:\n{run.err[-4000:]}"
    assert "Traceback" not in run.err, run.err[-4000:]
    assert re.search(pattern, run.err), f"/{pattern}/ not in:\n{run.err[-4000:]}"
    assert run.leftover() == [], "processes of the run left behind"
