"""process_alive: used by leases and temp-file cleanup to tell dead owners."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from checkpoint_store._util.liveness import process_alive


def test_running_and_exited_processes():
    assert process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid)
    assert not process_alive(0) and not process_alive(-5)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_zombie_is_dead():
    # Exited but not reaped: os.kill(pid, 0) still succeeds on it.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 10
    while time.time() < deadline:
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        time.sleep(0.02)
    os.kill(child.pid, 0)  # the signal check alone would call it alive
    assert not process_alive(child.pid)
    child.wait()
