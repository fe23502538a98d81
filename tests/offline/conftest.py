"""One local Ray cluster per module that asks for it: two logical GPUs, four CPUs (a Ray
start costs ~5 s, an engine actor ~5 s; the runtime tests share one per module)."""
import pytest
import ray


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_gpus=2, num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
