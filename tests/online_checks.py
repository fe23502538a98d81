"""Checks the live online tests share."""
from __future__ import annotations

import time
from typing import Callable, Optional


def trained_exactly_once(drain: Callable[[], None], sample_ledger: Callable[[], dict], timeout_s: float,
                         explain: Optional[Callable[[], str]] = None) -> dict:
    """Wait (draining) until every stored sample is trained exactly once in what the
    adapters keep, for at most ``timeout_s``; then assert it. ``explain`` says what the
    deployment was doing when it was not."""
    deadline = time.monotonic() + timeout_s
    while True:
        drain()
        ledger = sample_ledger()
        counts = {seq: ledger["trained"].get(seq, 0) for seq in range(ledger["stored"])}
        if set(counts.values()) <= {1} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    expected = {seq: 1 for seq in range(ledger["stored"])}
    assert counts == expected, explain() if explain is not None else counts
    return ledger
