"""Run a multi-LLM application on a Ray cluster (the offline job of raycolo).

    ray job submit --working-dir . -- python jobs/run_dag.py \
        --dag examples/tiny.yaml --output /abs/path/out/tiny [--input requests.jsonl] \
        [--policy samullm] [--profile cpu]

Also runs directly with ``python jobs/run_dag.py ...`` (a local cluster is started when
no ``RAY_ADDRESS`` is set). Writes outputs.parquet, report.json and gantt.png to
``--output``; the last line printed is ``report: PATH``. Bad input: one ``error:`` line
on stderr, exit status 2.
"""
import sys

from raycolo.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["run-dag", *sys.argv[1:]]))
