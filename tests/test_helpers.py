"""The test helpers themselves: a command that outlives its timeout leaves nothing running behind it."""
import os
import subprocess
import sys
import time

import pytest

import helpers

# a launcher that starts a worker (as torchrun does), says its pid, and both outlive any test's patience
LAUNCHER = ("import subprocess, sys, time\n"
            "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "open(sys.argv[1], 'w').write(str(worker.pid))\n"
            "time.sleep(120)\n")


def running(pid):
    """Alive and not a zombie (a killed process whose parent is gone is reaped by init, soon)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_timeout_kills_the_launcher_and_its_workers(tmp_path):
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        helpers.run_commands([sys.executable, "-c", LAUNCHER, str(pid_file)], timeout=3)
    worker = int(pid_file.read_text())
    deadline = time.time() + 5
    while running(worker) and time.time() < deadline:
        time.sleep(0.05)
    try:
        assert not running(worker), "the worker outlived its launcher's timeout"
    finally:
        if running(worker):  # leave nothing behind, whatever the outcome
            os.kill(worker, 9)
