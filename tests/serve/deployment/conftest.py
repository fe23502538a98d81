"""One deployment for every module of this package (its start, 2 nodes x 2 stages with
their stage workers, costs about a minute on 2 cores): 2 nodes x 2 stages of tiny-llama-s,
two ingress replicas, an API key, a small admission limit and a small body limit."""
import os

import pytest

from tests.support.online_checks import free_port, small_online_config
from tests.support.serve_checks import KEY, KEY_ENV, MODEL


@pytest.fixture(scope="package")
def front(tmp_path_factory):
    from raycolo.actors.serve import launch as serve_launch

    out = tmp_path_factory.mktemp("serve")
    config = small_online_config(
        out, nodes=2, stages=2, model=MODEL, lora={"checkpoint_every": 2}, stage={"kv_cache_tokens": 512},
        serve={"port": free_port(), "api_key_env": KEY_ENV, "max_ongoing_requests": 6, "replicas": 2,
               "max_body_bytes": 65536, "app_name": "raycolo-test"})
    os.environ[KEY_ENV] = KEY            # the local cluster's processes inherit it
    metrics_port = free_port()
    started, _ = serve_launch.init_ray(config, metrics_port=metrics_port)
    try:
        url = serve_launch.start(config)
        yield {"url": url, "config": config, "out": out, "metrics_port": metrics_port}
    finally:
        serve_launch.stop(config, started)
        os.environ.pop(KEY_ENV, None)
