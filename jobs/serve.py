"""The HTTP front under ``ray job submit``:

    ray job submit --working-dir . -- python jobs/serve.py --config examples/online.yaml

Joins the job's cluster (RAY_ADDRESS), deploys the front with Ray Serve, prints the URL
and runs until the job is stopped (``ray job stop``) or the application is deleted
(``serve shutdown``). Invalid input: one ``error:`` line, exit 2.
"""
import argparse
import sys

from raycolo.errors import RaycoloError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="online deployment config (YAML)")
    args = ap.parse_args()
    from raycolo.actors.serve.launch import serve_until_stopped
    from raycolo.online.config import load_online_config

    try:
        config = load_online_config(args.config)
        # joins RAY_ADDRESS (set by ray job submit); a cluster that does not answer is an
        # error line naming --address within seconds
        return serve_until_stopped(config, address="auto", say=lambda m: print(m, flush=True))
    except RaycoloError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
