"""Online workloads and node profiles (raycolo.online.tasks, raycolo.online.profiles).

Real sampling, real CSV files in tmp_path, real least-squares fits; no mocks.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from raycolo.rng import seeded_rng
from raycolo.errors import ConfigError
from raycolo.online.profiles import (PRESETS, REFERENCE_LENGTH, NodeProfile, fit_coefficients,
                                     fit_profile, preset, profile_names)
from raycolo.online.tasks import (DECODE_DISTRIBUTIONS, DEFAULT_MAX_TOKENS, LENGTH_DISTRIBUTIONS, OnlineTask,
                                  get_length_distribution, load_trace, poisson_workload,
                                  workload_summary)


# --------------------------------------------------------------------------- poisson workloads

def test_same_seed_same_workload_and_different_seed_differs():
    a = poisson_workload(10.0, 0.5, 200, seed=7)
    assert a == poisson_workload(10.0, 0.5, 200, seed=7)
    assert a != poisson_workload(10.0, 0.5, 200, seed=8)


def test_task_ids_follow_arrival_order():
    tasks = poisson_workload(5.0, 0.3, 300, seed=1, batch=4)
    assert [t.task_id for t in tasks] == list(range(300))
    arrivals = [t.arrival_s for t in tasks]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert all(t.batch == 4 for t in tasks)


def test_arrival_rate_matches():
    rate = 40.0
    tasks = poisson_workload(rate, 0.5, 5000, seed=3)
    gaps = np.diff([0.0] + [t.arrival_s for t in tasks])
    assert abs(gaps.mean() - 1 / rate) < 0.1 / rate


@pytest.mark.parametrize("train_rate", [0.2, 0.5, 0.8])
def test_training_fraction_matches(train_rate):
    tasks = poisson_workload(10.0, train_rate, 5000, seed=11)
    assert abs(np.mean([t.is_train for t in tasks]) - train_rate) < 0.03


def test_train_rate_extremes():
    assert not any(t.is_train for t in poisson_workload(1.0, 0.0, 500))
    assert all(t.is_train for t in poisson_workload(1.0, 1.0, 500))


def test_decode_tokens_only_for_inference():
    dist = DECODE_DISTRIBUTIONS["default"]
    for t in poisson_workload(10.0, 0.5, 2000, seed=2):
        if t.is_train:
            assert t.decode_tokens == 0
        else:
            assert dist.min <= t.decode_tokens <= dist.max
            assert t.max_tokens == dist.max == DEFAULT_MAX_TOKENS  # the cap: none is cut short


def test_max_tokens_column_and_its_default(tmp_path):
    path = write(tmp_path, "timestamp,length,kind,decode_tokens,max_tokens\n"
                           "0,5,inference,3,8\n1,5,inference,600,\n2,5,inference,4,\n3,5,train,,\n")
    a, b, c, d = load_trace(path)
    assert (a.decode_tokens, a.max_tokens, a.token_budget) == (3, 8, 8)
    assert (b.max_tokens, c.max_tokens) == (600, DEFAULT_MAX_TOKENS)  # at least decode_tokens
    assert d.max_tokens is None and d.token_budget == 0
    with pytest.raises(ValueError, match="decode_tokens 9 exceeds max_tokens 8"):
        OnlineTask(0, "inference", 0.0, 5, 1, 9, 8)


def test_train_rate_does_not_change_arrivals_or_lengths():
    low = poisson_workload(10.0, 0.1, 500, seed=4)
    high = poisson_workload(10.0, 0.9, 500, seed=4)
    assert [(t.arrival_s, t.length) for t in low] == [(t.arrival_s, t.length) for t in high]


def test_shp_lengths_vary_more_than_hh_rlhf():
    hh = np.array([t.length for t in poisson_workload(10, 0.5, 5000, "hh-rlhf", seed=5)])
    shp = np.array([t.length for t in poisson_workload(10, 0.5, 5000, "shp", seed=5)])
    assert shp.std() > hh.std() and np.median(shp) > np.median(hh)


@pytest.mark.parametrize("name", sorted(LENGTH_DISTRIBUTIONS))
def test_lengths_inside_bounds(name):
    dist = LENGTH_DISTRIBUTIONS[name]
    lengths = dist.sample(20000, seeded_rng(0, "test", name))
    assert lengths.dtype == np.int64
    assert lengths.min() >= dist.min and lengths.max() <= dist.max
    assert abs(np.median(lengths) - dist.median) < 0.1 * dist.median


def test_unknown_length_distribution():
    with pytest.raises(ConfigError, match=re.escape(
            "--lengths: unknown distribution 'x' (choose hh-rlhf, shp)")):
        get_length_distribution("x")
    with pytest.raises(ConfigError, match="^--lengths: unknown"):
        poisson_workload(1.0, 0.5, 10, lengths="x")


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate=-1), "--rate: must be above 0, got -1"),
    (dict(rate=0), "--rate: must be above 0, got 0"),
    (dict(rate=float("nan")), "--rate: must be a finite number, got nan"),
    (dict(rate=float("inf")), "--rate: must be a finite number, got inf"),
    (dict(rate=1e30), "--rate: must be at most 1000000, got 1e+30"),
    (dict(train_rate=1.5), "--train-rate: must be at most 1, got 1.5"),
    (dict(train_rate=-0.1), "--train-rate: must be at least 0, got -0.1"),
    (dict(tasks=0), "--tasks: must be at least 1, got 0"),
    (dict(tasks=2.5), "--tasks: must be an integer"),
    (dict(batch=0), "--batch: must be at least 1, got 0"),
    (dict(tasks=True), "--tasks: must be an integer"),
    (dict(tasks=10**30), "--tasks: must be at most 10000000"),
    (dict(rate=True), "--rate: must be a number"),
])
def test_poisson_validation_messages(kwargs, message):
    args = dict(rate=1.0, train_rate=0.5, tasks=10) | kwargs
    with pytest.raises(ConfigError) as err:
        poisson_workload(**args)
    assert str(err.value).startswith(message)


def test_workload_summary():
    tasks = poisson_workload(20.0, 0.25, 4000, seed=9)
    summary = workload_summary(tasks)
    assert summary["tasks"] == 4000
    assert summary["inference"] + summary["train"] == 4000
    assert summary["train"] == sum(t.is_train for t in tasks)
    assert summary["mean_length"] == pytest.approx(np.mean([t.length for t in tasks]))
    assert summary["std_length"] == pytest.approx(np.std([t.length for t in tasks]))
    assert summary["duration_s"] == pytest.approx(tasks[-1].arrival_s - tasks[0].arrival_s)
    assert summary["rate_per_s"] == pytest.approx(20.0, rel=0.1)
    assert workload_summary([])["tasks"] == 0


def test_online_task_kind_checked():
    assert OnlineTask(0, "train", 0.0, 10).is_train
    with pytest.raises(ValueError, match="kind"):
        OnlineTask(0, "serve", 0.0, 10)


# --------------------------------------------------------------------------- traces

def write(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_trace_sorted_and_shifted(tmp_path):
    path = write(tmp_path, "timestamp,length\n12.5,40\n10.0,20\n11.0,30\n")
    tasks = load_trace(path)
    assert [t.length for t in tasks] == [20, 30, 40]
    assert [t.arrival_s for t in tasks] == [0.0, 1.0, 2.5]
    assert [t.task_id for t in tasks] == [0, 1, 2]
    assert all(t.kind == "inference" and t.batch == 1 and t.decode_tokens >= 1 for t in tasks)


def test_trace_kind_batch_and_decode_columns(tmp_path):
    path = write(tmp_path, "timestamp,length,kind,batch,decode_tokens\n"
                           "0,10,train,2,7\n1,20,inference,,5\n2,30, Inference ,3,\n")
    a, b, c = load_trace(path, seed=3)
    assert (a.kind, a.batch, a.decode_tokens) == ("train", 2, 0)  # decode ignored for train
    assert (b.kind, b.batch, b.decode_tokens) == ("inference", 1, 5)  # empty batch -> 1
    assert (c.kind, c.batch) == ("inference", 3)
    assert c.decode_tokens == load_trace(path, seed=3)[2].decode_tokens  # sampled, seeded


def test_trace_train_rate_without_kind_column(tmp_path):
    rows = "".join(f"{i * 0.1},{10 + i % 50}\n" for i in range(5000))
    path = write(tmp_path, "timestamp,length\n" + rows)
    tasks = load_trace(path, train_rate=0.4, seed=1)
    assert abs(np.mean([t.is_train for t in tasks]) - 0.4) < 0.03
    assert tasks == load_trace(path, train_rate=0.4, seed=1)
    assert not any(t.is_train for t in load_trace(path))  # default train rate is 0
    assert len(load_trace(path, limit=10)) == 10


def test_trace_train_rate_with_kind_column_is_an_error(tmp_path):
    path = write(tmp_path, "timestamp,length,kind\n0,10,train\n")
    with pytest.raises(ConfigError, match="^--train-rate: cannot be used"):
        load_trace(path, train_rate=0.5)


@pytest.mark.parametrize("text, message", [
    ("timestamp,kind\n0,train\n", "trace.csv: missing column 'length'"),
    ("length\n5\n", "trace.csv: missing column 'timestamp'"),
    ("timestamp,length\n0,5\n1,7\n2,0\n", "trace.csv: row 3: length: must be at least 1, got '0'"),
    ("timestamp,length\n0,5\n1,2.5\n", "trace.csv: row 2: length: must be an integer, got '2.5'"),
    ("timestamp,length\n0,5\n1,\n", "trace.csv: row 2: length: must be an integer, got ''"),
    ("timestamp,length\n0,5\nsoon,7\n", "trace.csv: row 2: timestamp: must be a number of seconds within ±1e+08"),
    ("timestamp,length,kind\n0,5,train\n1,5,serve\n",
     "trace.csv: row 2: kind must be 'inference' or 'train'"),
    ("timestamp,length,batch\n0,5,-2\n", "trace.csv: row 1: batch: must be at least 1, got '-2'"),
    ("timestamp,length,decode_tokens\n0,5,1\n1,5,-1\n",
     "trace.csv: row 2: decode_tokens: must be at least 0, got '-1'"),
    ("timestamp,length,decode_tokens,max_tokens\n0,5,3,3\n1,5,9,8\n",
     "trace.csv: row 2: max_tokens must be at least decode_tokens"),
    ("timestamp,length,max_tokens\n0,5,0\n", "trace.csv: row 1: max_tokens: must be at least 1, got '0'"),
    ("timestamp,length\n0,1e30\n", "trace.csv: row 1: length: must be at most 1048576, got '1e30'"),
    ("timestamp,length,batch\n0,5,1e30\n", "trace.csv: row 1: batch: must be at most 4096, got '1e30'"),
    ("timestamp,length,decode_tokens\n0,5,1e30\n", "trace.csv: row 1: decode_tokens: must be at most 1048576, got '1e30'"),
    ("timestamp,length\n1e300,5\n0,5\n", "trace.csv: row 1: timestamp: must be a number of seconds within ±1e+08"),
    ("timestamp,length\n", "trace.csv: trace has no rows"),
    ("", "trace.csv: trace file is empty"),
])
def test_trace_errors(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_trace(path)
    assert str(err.value) == f"{path.parent}/{message}"


def test_trace_file_not_found(tmp_path):
    with pytest.raises(ConfigError, match=r"trace\.csv: trace file not found$"):
        load_trace(tmp_path / "trace.csv")


# --------------------------------------------------------------------------- profiles

@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("stages", [2, 4])
def test_preset_eta_reproduces_table_latency(name, stages):
    p = preset(name, stages)
    ref = REFERENCE_LENGTH
    assert p.eta_f * ref**2 * stages == pytest.approx(p.forward_latency_s, rel=1e-12)
    assert p.eta_b * ref**2 * stages == pytest.approx(p.backward_latency_s, rel=1e-12)
    assert p.forward_s(1, ref) * stages == pytest.approx(PRESETS[name].forward_latency_s)
    assert p.backward_s(3, ref) == pytest.approx(3 * p.backward_latency_s / stages)
    assert p.weight_bytes_per_stage * stages == pytest.approx(PRESETS[name].weight_bytes)
    assert 0 < p.free_bytes < p.gpu_memory_bytes


def test_preset_memory_figures():
    p = preset("llama-8b", 2)
    # 16 layers per stage, 1024-wide K and V, 2 bytes each.
    assert p.kv_bytes_per_token == 2 * 16 * 1024 * 2
    assert p.activation_bytes_per_token == 34 * 4096 * 16
    assert p.inference_bytes(2, 100) == p.kv_bytes_per_token * 200
    assert p.train_bytes(2, 100) == (p.kv_bytes_per_token + p.activation_bytes_per_token) * 200
    assert p.decode_floor_s == pytest.approx(13 * 2**30 / 2 / 2.0e12)


def test_decode_step_floor():
    p = preset("gpt-400m", 2)
    assert p.decode_step_s(1, 10) == p.decode_floor_s  # memory-bound: short context
    long_context = 10**6
    assert p.decode_step_s(4, long_context) == pytest.approx(p.eta_f * 4 * (2 * long_context + 1))
    assert p.decode_step_s(4, long_context) > p.decode_floor_s


def test_unknown_preset_and_stage_validation():
    with pytest.raises(ConfigError, match=re.escape(
            "--model: unknown model 'x' (choose " + ", ".join(profile_names()) + ")")):
        preset("x")
    for bad in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="^--stages: must be a positive integer"):
            preset("gpt-400m", bad)
    with pytest.raises(ConfigError, match="^--stages: gpt-400m has only 12 layers"):
        preset("gpt-400m", 13)
    with pytest.raises(ConfigError, match="^--stages: llama-70b .*at least 2 stages"):
        preset("llama-70b", 1)
    assert preset("llama-70b", 2).weight_bytes_per_stage == 66 * 2**30


def test_profile_is_frozen_and_strict():
    p = preset("gpt-1.4b")
    with pytest.raises(Exception):
        p.eta_f = 1.0
    with pytest.raises(Exception):
        NodeProfile(**p.model_dump(), extra_field=1)


def synthetic_samples(eta_f, eta_b, n=200, noise=0.05, seed=0):
    rng = seeded_rng(seed, "test", "fit")
    batch = rng.integers(1, 9, n)
    length = rng.integers(16, 1024, n)
    x = batch * length.astype(float) ** 2
    forward = eta_f * x * (1 + noise * rng.standard_normal(n))
    backward = eta_b * x * (1 + noise * rng.standard_normal(n))
    return np.column_stack([batch, length, forward, backward])


def test_fit_recovers_known_coefficients():
    eta_f, eta_b = 2.3e-7, 3.1e-7
    fit = fit_coefficients(synthetic_samples(eta_f, eta_b))
    assert abs(fit.eta_f / eta_f - 1) < 0.02 and abs(fit.eta_b / eta_b - 1) < 0.02
    assert fit.r2_f > 0.95 and fit.r2_b > 0.95


def test_fit_profile_from_dicts_keeps_the_rest():
    base = preset("gpt-2.5b")
    data = synthetic_samples(1e-7, 2e-7, seed=1)
    rows = [dict(zip(("batch", "length", "forward_s", "backward_s"), r)) for r in data]
    fitted = fit_profile(rows, base)
    assert fitted.eta_f == pytest.approx(1e-7, rel=0.02)
    assert fitted.eta_b == pytest.approx(2e-7, rel=0.02)
    assert fitted.model_dump(exclude={"eta_f", "eta_b"}) == \
        base.model_dump(exclude={"eta_f", "eta_b"})


@pytest.mark.parametrize("samples, message", [
    ([], "no samples"),
    (np.zeros((0, 4)), "no samples"),
    ([[1, 100, 0.1, -0.2]], "sample 1: values must be positive"),
    ([[1, 100, 0.1, 0.2], [0, 100, 0.1, 0.2]], "sample 2: values must be positive"),
    ([{"batch": 1, "length": 10, "forward_s": 0.1}], "sample 1: missing 'backward_s'"),
    (np.ones((3, 3)), "4 columns"),
])
def test_fit_errors(samples, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        fit_coefficients(samples)


def test_fit_with_intercept_recovers_a_fixed_cost_per_op():
    rng = seeded_rng(3, "test", "fit-intercept")
    batch = rng.integers(1, 5, 60)
    length = rng.integers(8, 64, 60)
    x = batch * length.astype(float) ** 2
    a, eta_f, eta_b = 4e-3, 2e-7, 5e-7
    noise = 1 + 0.01 * rng.standard_normal((2, 60))
    data = np.column_stack([batch, length, (a + eta_f * x) * noise[0], (a + eta_b * x) * noise[1]])
    fit = fit_coefficients(data, intercept=True)
    assert fit.overhead_s == pytest.approx(a, rel=0.05)
    assert fit.eta_f == pytest.approx(eta_f, rel=0.05) and fit.eta_b == pytest.approx(eta_b, rel=0.05)
    plain = fit_coefficients(data)          # through the origin: η soaks up the fixed cost
    assert plain.overhead_s == 0 and plain.eta_f > 1.5 * eta_f
    base = preset("gpt-400m")
    fitted = fit_profile(data, base, intercept=True, decode_s=[a + 1e-3] * 5)
    assert fitted.op_overhead_s == pytest.approx(a, rel=0.05)
    assert fitted.decode_floor_s == pytest.approx(1e-3, abs=3e-4)
    assert fitted.forward_s(1, 10) == pytest.approx(fitted.op_overhead_s + fitted.eta_f * 100)
    assert fitted.decode_step_s(1, 10) == pytest.approx(fitted.op_overhead_s + fitted.decode_floor_s)


def test_fit_with_intercept_falls_back_to_the_origin_when_the_cost_would_be_negative():
    data = synthetic_samples(1e-7, 2e-7, n=50, noise=0.0, seed=4)
    data[:, 2:] -= 0.5 * data[:, 2:].min()       # y = η·x − c: the best intercept is negative
    fit = fit_coefficients(data, intercept=True)
    assert fit.overhead_s == 0.0 and fit == fit_coefficients(data)
