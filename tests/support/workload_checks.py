"""What every workload must hold (tests/offline/test_workload*.py): the repository's root, and
the per-node length checks.
"""
from __future__ import annotations

from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
def _check_lengths(workload) -> None:
    """Every node: outputs in [1, max_output_tokens], prompt + output within the context."""
    for name, w in workload.nodes.items():
        node = workload.app.node(name)
        n = len(w)
        assert n > 0, name
        for arr in (w.input_len, w.output_len, w.item, w.successor, w.chain_head, w.terminal):
            assert len(arr) == n, name
        assert w.max_output == node.max_output_tokens
        assert w.model.name == node.model
        assert (w.input_len >= 1).all(), name
        assert (w.output_len >= 1).all(), name
        assert (w.output_len <= node.max_output_tokens).all(), name
        assert (w.input_len + w.output_len <= w.model.context_length).all(), name
