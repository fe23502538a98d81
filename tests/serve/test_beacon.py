"""The controller's liveness beacon: a watcher learns within milliseconds that the process
holding it ended (SIGKILL here), and not before."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from raycolo.online.serving.beacon import Beacon, BeaconAddress, watch

HOLDER = ("import sys, time; from raycolo.online.serving.beacon import Beacon; b = Beacon('127.0.0.1'); "
          "print(b.address.port, flush=True); time.sleep(600)")


def test_a_killed_process_is_known_gone_at_once_and_a_live_one_is_not():
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        gone = threading.Event()
        watch(BeaconAddress("127.0.0.1", port), gone.set)
        assert not gone.wait(0.5)                     # alive: no news
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert gone.wait(5.0)
        assert time.monotonic() - killed < 0.5
    finally:
        proc.kill()
        proc.wait()


def test_a_beacon_already_gone_is_known_at_once_and_close_ends_it():
    beacon = Beacon("127.0.0.1")
    address = beacon.address
    seen = threading.Event()
    watch(address, seen.set)
    time.sleep(0.1)
    assert not seen.is_set()
    beacon.close()
    assert seen.wait(2.0)
    refused = threading.Event()
    watch(address, refused.set)                        # nothing listens there now
    assert refused.wait(2.0)
