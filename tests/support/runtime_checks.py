"""The offline runtime's test contract (tests/offline/test_runtime*.py): a run's config on
the examples, and every request answered exactly once, in the journal and in
outputs.parquet, with the report agreeing.
"""
import json
from pathlib import Path

import pandas as pd

from raycolo.offline.runtime.setup import RunConfig


ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# Planning needs a replica start time; tests give it rather than measure it each run.
START_S = 5.0

def _config(tmp_path, dag, **kw) -> RunConfig:
    values = dict(dag=str(EXAMPLES / dag), output=str(tmp_path / "out"), profile="cpu",
                  gpus=2, nvlink_group=1, replica_start_s=START_S, progress=False, gantt=False)
    values.update(kw)
    return RunConfig(**values)


def _check_exactly_once(report: dict, out: Path) -> pd.DataFrame:
    table = pd.read_parquet(out / "outputs.parquet")
    journal = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines() if line]
    assert report["requests_done"] == report["requests_total"] == len(table) == len(journal)
    assert table["key"].is_unique and len({r["key"] for r in journal}) == len(journal)
    for node, size in report["models"].items():
        got = sorted(table.loc[table["node"] == node, "index"])
        assert got == list(range(len(got))), node
    assert (table["output_tokens"] >= 1).all()
    assert set(table["finish_reason"]) <= {"stop", "length"}
    return table


def _short_small(dag: Path) -> Path:
    """tiny.yaml with 'small' answering in at most 4 tokens and 'medium' in up to 512."""
    dag.write_text((EXAMPLES / "tiny.yaml").read_text().replace(
        "{name: small, model: tiny-llama-s, max_output_tokens: 64}",
        "{name: small, model: tiny-llama-s, max_output_tokens: 4}").replace(
        "{name: medium, model: tiny-llama-m, max_output_tokens: 64}",
        "{name: medium, model: tiny-llama-m, max_output_tokens: 512}"))
    return dag
