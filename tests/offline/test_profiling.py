"""Profiler, latency-model fit and calibration on real tiny models (no mocks)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from raycolo.catalog import get_model
from raycolo.cli.main import resolve_profile_dir
from raycolo.offline.costmodel.fit import IterationSample, fit_profile
from raycolo.offline.costmodel.latency import IterationLatency, LatencyProfile, default_profile
from raycolo.offline.costmodel.length_sampler import OutputLengthSampler, load_ecdf, write_ecdf
from raycolo.errors import ConfigError
from raycolo.hardware import ClusterSpec
from raycolo.offline.profiler import SweepSettings, profile_model
from raycolo.online.stages.colocated_profile import measure_colocated

ROOT = Path(__file__).resolve().parents[2]

TRUTH = LatencyProfile(
    model="synthetic", tp=1, source="measured",
    compute_intercept_s=[0.002, 0.0021, 0.0023, 0.0026, 0.003, 0.0036, 0.0045, 0.006, 0.009, 0.014, 0.02],
    compute_s_per_tflop=[40, 38, 35, 30, 26, 22, 18, 15, 12, 10, 9],
    prepare_intercept_s=0.0, prepare_s_per_token=2e-6, sample_intercept_s=0.0, sample_s_per_seq=1e-4,
    load_s=1.5, prefill_intercept_s=[0.004] * 11, prefill_s_per_tflop=[60] * 11,
    prefill_s_per_token=9e-6, prefill_s_per_seq=3e-4)


def synthetic_samples(rng, count=3000):
    """Iterations whose seconds follow TRUTH exactly (FLOPs drawn independently)."""
    lat = IterationLatency(get_model("tiny-llama-m"), TRUTH, max_seqs=1024)
    samples = []
    for _ in range(count):
        n = int(np.exp(rng.uniform(0, np.log(1024))))  # every request-count bucket gets samples
        tokens = int(rng.integers(n, 64 * n + 1))
        flops = float(rng.uniform(0.01, 2.0)) * 1e12 * n / 64
        if rng.random() < 0.3:
            seconds = lat.prefill_base[n] + lat.prefill_c[n] * flops + lat.prefill_per_token * tokens
            samples.append(IterationSample("prefill", n, tokens, flops, seconds))
        else:
            b = TRUTH.bucket_of(np.array([n]))[0]
            seconds = (TRUTH.compute_intercept_s[b] + TRUTH.compute_s_per_tflop[b] * flops / 1e12
                       + TRUTH.prepare_s_per_token * tokens + TRUTH.sample_s_per_seq * n)
            samples.append(IterationSample("decode", n, tokens, flops, seconds))
    return samples


def test_fit_reproduces_known_coefficients():
    rng = np.random.default_rng(5)
    fitted, stats = fit_profile(synthetic_samples(rng), "synthetic", 1, load_s=1.5)
    assert stats["r2"] > 0.999999
    np.testing.assert_allclose(fitted.compute_intercept_s, TRUTH.compute_intercept_s, rtol=1e-4)
    np.testing.assert_allclose(fitted.compute_s_per_tflop, TRUTH.compute_s_per_tflop, rtol=1e-4)
    np.testing.assert_allclose(fitted.prefill_intercept_s, TRUTH.prefill_intercept_s, rtol=1e-4)
    np.testing.assert_allclose(fitted.prefill_s_per_tflop, TRUTH.prefill_s_per_tflop, rtol=1e-4)
    for name in ("prepare_s_per_token", "sample_s_per_seq", "prefill_s_per_token", "prefill_s_per_seq"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), rel=1e-4), name


def test_the_full_sampler_is_taken_off_the_iterations_that_ran_it():
    """Decode iterations that ran the full sampler cost f0 + f1 * n more: given that cost,
    the fit recovers the plain coefficients and the profile predicts both kinds; a fit that
    is not told of it (every iteration called plain) is biased."""
    rng = np.random.default_rng(7)
    f0, f1 = 4e-4, 6e-6
    samples = []
    for s in synthetic_samples(rng):
        if s.kind == "decode" and rng.random() < 0.4:
            s = IterationSample(s.kind, s.num_seqs, s.tokens, s.flops, s.seconds + f0 + f1 * s.num_seqs,
                                plain_sampling=False)
        samples.append(s)
    fitted, _ = fit_profile(samples, "synthetic", 1, load_s=1.5, full_sampler=(f0, f1))
    np.testing.assert_allclose(fitted.compute_intercept_s, TRUTH.compute_intercept_s, rtol=1e-4)
    assert (fitted.full_sampler_intercept_s, fitted.full_sampler_s_per_seq) == (f0, f1)
    model = get_model("tiny-llama-m")
    plain = IterationLatency(model, fitted)
    drawn = IterationLatency(model, fitted, plain_sampling=False)
    for n in (1, 7, 48, 300):
        assert drawn.decode_seconds(n, 100 * n) - plain.decode_seconds(n, 100 * n) == pytest.approx(f0 + f1 * n)
        assert drawn.prefill_seconds(n, 50 * n, 2500 * n) == plain.prefill_seconds(n, 50 * n, 2500 * n)
    unaware, _ = fit_profile([IterationSample(s.kind, s.num_seqs, s.tokens, s.flops, s.seconds) for s in samples],
                             "synthetic", 1, load_s=1.5)
    assert not np.allclose(unaware.compute_intercept_s, TRUTH.compute_intercept_s, rtol=1e-2)


def test_engine_iterations_say_whether_the_full_sampler_ran():
    from raycolo.engine.base import SamplingParams
    from raycolo.engine.factory import create_engine
    from raycolo.offline.profiler import engine_config

    engine = create_engine(engine_config("tiny-llama-s"))
    prompts = [[5, 6, 7, 8]] * 3
    engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(r.plain_sampling for r in engine.stats.iterations)
    engine.stats.iterations.clear()
    engine.generate(prompts, [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=i) for i in range(3)])
    assert len(engine.stats.iterations) == 4 and not any(r.plain_sampling for r in engine.stats.iterations)
    engine.stats.iterations.clear()        # one row that draws puts the whole batch on the full sampler
    engine.generate(prompts, [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8 * (i == 0), seed=i)
                              for i in range(3)])
    assert not any(r.plain_sampling for r in engine.stats.iterations)
    engine.release()


@pytest.mark.parametrize("model", ["tiny-llama-s", "tiny-qwen2-s", "tiny-mistral-s"])
def test_a_checkpoint_directory_has_the_spec_of_its_config(model, tmp_path):
    """``raycolo profile --model DIR`` costs the checkpoint's own shape: read from its
    config.json, it matches the catalog entry the checkpoint was built from."""
    from raycolo.catalog import model_spec, spec_of_checkpoint
    from raycolo.engine.models import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(model, tmp_path / "ckpt", 0)
    spec, want = spec_of_checkpoint(ckpt, name=model), get_model(model)
    for field in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "context_length",
                  "tied_embeddings", "hf_architecture"):
        assert getattr(spec, field) == getattr(want, field), field
    assert spec.matmul_params_per_token == want.matmul_params_per_token
    assert model_spec(str(ckpt)).name == "ckpt" and model_spec(model) == want
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"hidden_size": 64}')
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        spec_of_checkpoint(tmp_path / "bad")


def test_fit_with_noise_stays_close_and_never_negative():
    rng = np.random.default_rng(6)
    samples = synthetic_samples(rng)
    for s in samples:
        s.seconds *= 1 + 0.05 * rng.standard_normal()
    fitted, stats = fit_profile(samples, "synthetic", 1, load_s=0.0)
    assert min(fitted.compute_intercept_s + fitted.compute_s_per_tflop) >= 0
    np.testing.assert_allclose(fitted.compute_s_per_tflop, TRUTH.compute_s_per_tflop, rtol=0.1)
    assert 0.9 < stats["r2"] <= 1


def test_one_off_iterations_are_dropped_from_the_fit(monkeypatch):
    """A few iterations 30 times their cost (a kernel compiled on first use, a burst on a
    shared machine) are dropped: the fit is TRUTH's again and says how many it dropped;
    kept, they pull the coefficients of their buckets off."""
    import raycolo.offline.costmodel.fit as fit_module

    samples = synthetic_samples(np.random.default_rng(8))
    hit = [i for i, s in enumerate(samples) if s.kind == "decode" and 16 < s.num_seqs <= 32][:3]
    hit += [i for i, s in enumerate(samples) if s.kind == "prefill"][:2]
    for i in hit:
        samples[i].seconds *= 30
    fitted, stats = fit_profile(samples, "synthetic", 1, load_s=0.0)
    assert stats["outlier_iterations"] == 5 and stats["r2"] > 0.999999
    np.testing.assert_allclose(fitted.compute_intercept_s, TRUTH.compute_intercept_s, rtol=1e-4)
    np.testing.assert_allclose(fitted.compute_s_per_tflop, TRUTH.compute_s_per_tflop, rtol=1e-4)
    np.testing.assert_allclose(fitted.prefill_s_per_tflop, TRUTH.prefill_s_per_tflop, rtol=1e-4)
    monkeypatch.setattr(fit_module, "OUTLIER_RATIO", float("inf"))
    kept, stats = fit_profile(samples, "synthetic", 1, load_s=0.0)
    assert stats["outlier_iterations"] == 0
    bucket = TRUTH.bucket_of(np.array([32]))[0]
    assert not np.isclose(kept.compute_s_per_tflop[bucket], TRUTH.compute_s_per_tflop[bucket], rtol=0.05) or \
        not np.isclose(kept.compute_intercept_s[bucket], TRUTH.compute_intercept_s[bucket], rtol=0.05)


def test_profile_file_round_trips(tmp_path):
    path = tmp_path / "m.tp1.json"
    TRUTH.save(path)
    assert LatencyProfile.load(path) == TRUTH
    default = default_profile(get_model("vicuna-13b-v1.5"), ClusterSpec(), 2)
    default.save(path)
    assert LatencyProfile.load(path) == default
    path.write_text('{"model": "x"}')
    with pytest.raises(ConfigError, match="invalid latency profile"):
        LatencyProfile.load(path)


def test_ecdf_file_round_trips(tmp_path):
    lengths = [5, 5, 7, 9, 9, 9, 300]
    path = write_ecdf(tmp_path / "m.csv", lengths, "MEASURED test")
    values, cdf = load_ecdf(str(path))
    assert values.tolist() == [5, 7, 9, 300]
    np.testing.assert_allclose(cdf, [2 / 7, 3 / 7, 6 / 7, 1.0], atol=1e-6)
    write_ecdf(tmp_path / "tiny-llama-s.csv", lengths, "MEASURED test")
    sampler = OutputLengthSampler(get_model("tiny-llama-s"), tmp_path)
    assert sampler.mean == pytest.approx(np.mean(lengths))


@pytest.fixture(scope="module")
def small_profile(tmp_path_factory):
    """A profile of a checkpoint directory (tiny-llama-s saved with random weights), under
    the catalog name it costs."""
    from raycolo.engine.models import save_tiny_checkpoint

    out = tmp_path_factory.mktemp("profile")
    ckpt = save_tiny_checkpoint("tiny-llama-s", tmp_path_factory.mktemp("ckpt") / "llama-s", 0)
    settings = SweepSettings(batch_sizes=(1, 4, 8), context_lens=(16, 96), decode_steps=4, rounds=2,
                             mixed_requests=8, ecdf_requests=12, load_repeats=1, sampler_batches=(1, 8),
                             sampler_repeats=1)
    profile, stats = profile_model(str(ckpt), out, settings=settings, colocated=measure_colocated,
                                   name="tiny-llama-s")
    return out, profile, stats


def test_profiler_writes_the_files_the_cost_model_reads(small_profile):
    out, profile, stats = small_profile
    assert LatencyProfile.load(out / "tiny-llama-s.tp1.json") == profile
    assert profile.source == "measured" and profile.load_s > 0
    values, cdf = load_ecdf(str(out / "ecdf" / "tiny-llama-s.csv"))
    assert values.max() <= 256 and cdf[-1] == 1.0
    assert stats["iterations"] > 20 and stats["r2"] > 0.1  # timing noise on a shared CPU
    dp = stats["decode_predictor"]      # Harli's stage 1, fitted and checked on held-out iterations
    assert dp["held_out_iterations"] > 3 and 0 <= dp["held_out_mape"] < 1 and dp["c0"] > 0
    # stage 2, fitted to fine-tune ops run between decode iterations on a LoRA stage
    assert dp["colocated_iterations"] >= 18 and dp["colocated_held_out_iterations"] >= 3
    assert (dp["b1"], dp["k1"]) != (1.0, 1.0) and 0 <= dp["colocated_held_out_mape"] < 1
    fit = json.loads((out / "tiny-llama-s.tp1.fit.json").read_text())
    assert fit["model"] == "tiny-llama-s" and fit["checkpoint"].endswith("llama-s")
    assert profile.engine == "torch" and re.fullmatch(r"cpu .*, \d{4}-\d{2}-\d{2}", profile.measured_on)
    assert profile.full_sampler_intercept_s + 8 * profile.full_sampler_s_per_seq >= 0
    # the machine's reference batch, timed once before the sweep and after each of its runs
    # (2 rounds of 6 points, the mixed run, the sampled and the greedy output-length runs)
    assert fit["reference_marks"] == 1 + 2 * 6 + 3 and fit["sweep"]["rounds"] == 2
    assert 0 < fit["reference_s"] < 5 and fit["reference_spread"] >= 1
    assert fit["machine_drift"] == pytest.approx(fit["reference_end_s"] / fit["reference_start_s"])


def test_plan_uses_a_profile_directory(small_profile, tmp_path):
    out, profile, _ = small_profile
    app = tmp_path / "app.yaml"
    app.write_text("""
requests: {count: 40, input_tokens: {distribution: uniform, min: 8, max: 64}}
nodes: [{name: a, model: tiny-llama-s, max_output_tokens: 64}]
edges: [{from: input, to: a}]
""")
    args = [sys.executable, "-m", "raycolo.cli", "plan", str(app), "--gpus", "1", "--nvlink-group", "1",
            "--gpu-memory", "4GiB", "--json"]
    with_profile = json.loads(subprocess.run(args + ["--profile", str(out)], capture_output=True,
                                             text=True, check=True).stdout)
    without = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
    # the CLI's plan is the planner's plan with the measured coefficients and eCDF
    from raycolo.offline.dag import load_app
    from raycolo.hardware import make_cluster
    from raycolo.offline.planner.problem import PlanningProblem
    from raycolo.offline.policies import get_policy
    from raycolo.offline.workload import build_workload
    workload = build_workload(load_app(app), seed=0, ecdf_dir=out / "ecdf")
    expected = get_policy("samullm")(PlanningProblem(workload, make_cluster(1, "4GiB", 1), profile_dir=out))
    assert with_profile["makespan_s"] == pytest.approx(expected.makespan_s, rel=1e-9)
    assert with_profile["makespan_s"] != pytest.approx(without["makespan_s"], rel=0.05)
    # measured load of a tiny model vs the default 8 s engine start-up of the roofline model
    assert with_profile["stages"][0]["models"][0]["load_s"] == pytest.approx(profile.load_s)
    assert without["stages"][0]["models"][0]["load_s"] > 8
    # each plan names the engine profile its costs came from, or the roofline defaults
    [measured] = with_profile["costed_from"]
    assert measured == {"model": "tiny-llama-s", "tp": 1, "source": "measured", "engine": "raycolo's torch engine",
                        "measured_on": profile.measured_on, "file": str(out / "tiny-llama-s.tp1.json"),
                        "note": f"measured on raycolo's torch engine, {profile.measured_on}"}
    [default] = without["costed_from"]
    assert default["source"] == "default" and default["engine"] is None and "roofline" in default["note"]
    table = subprocess.run(args[:-1] + ["--profile", str(out)], capture_output=True, text=True, check=True).stdout
    assert f"costed from: tiny-llama-s tp1: measured on raycolo's torch engine, {profile.measured_on} ({out})" in table


def test_shipped_cpu_profiles_cover_the_tiny_models():
    shipped = resolve_profile_dir("cpu")
    for model in ("tiny-llama-s", "tiny-llama-m", "tiny-llama-l"):
        profile = LatencyProfile.load(shipped / f"{model}.tp1.json")
        assert profile.source == "measured" and profile.model == model
        assert load_ecdf(str(shipped / "ecdf" / f"{model}.csv"))[1][-1] == 1.0


def test_validate_reports_predicted_and_measured_times():
    result = subprocess.run([sys.executable, "-m", "raycolo.cli", "validate", "--models", "tiny-llama-s",
                             "--requests", "4", "--repeats", "2", "--json"], capture_output=True, text=True, check=True)
    report = json.loads(result.stdout)
    assert {c["name"].split(" ")[0] for c in report["cases"]} >= {"tiny-llama-s", "2-model"}
    for case in report["cases"]:
        assert case["predicted_s"] > 0 and case["measured_s"] > 0
        assert case["error"] == pytest.approx((case["predicted_s"] - case["measured_s"]) / case["measured_s"])
        assert len(case["runs"]) == 2           # two request sets, their times summed
        for key in ("predicted_s", "measured_s", "predicted_known_lengths_s"):
            assert case[key] == pytest.approx(sum(r[key] for r in case["runs"]))
        assert case["set_errors"] == [r["error"] for r in case["runs"]]
    assert report["mape"] == pytest.approx(np.mean([abs(c["error"]) for c in report["cases"]]))
    assert report["mean_signed_error"] == pytest.approx(np.mean([c["error"] for c in report["cases"]]))
    assert report["repeats"] == 2
    model = next(c for c in report["cases"] if c["name"].startswith("tiny-llama-s"))
    assert all(r["reference_s"] > 0 and "machine_vs_profile" in r for r in model["runs"])


def test_validate_batches_times_a_checkpoint_directory_against_its_profile(small_profile, capsys):
    """``validate --batches`` (the real-size check on a GPU, here a tiny checkpoint on the
    CPU): one case per batch, its fixed lengths run for real and predicted from the
    checkpoint's profile under the catalog name it took."""
    from raycolo.cli.main import main

    out, _, stats = small_profile
    rc = main(["validate", "--profile", str(out), "--models", stats["checkpoint"], "--name", "tiny-llama-s",
               "--batches", "1,8", "--prompt-len", "40", "--output-len", "12", "--repeats", "2", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["batch"] for c in report["cases"]] == [1, 8]
    assert [c["name"] for c in report["cases"]] == ["tiny-llama-s b=1 (40+12)", "tiny-llama-s b=8 (40+12)"]
    assert report["batches"] == {"sizes": [1, 8], "prompt_len": 40, "output_len": 12}
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    for case in report["cases"]:
        assert len(case["runs_s"]) == 2 and case["measured_s"] == pytest.approx(float(np.median(case["runs_s"])))
        assert case["error"] == pytest.approx((case["predicted_s"] - case["measured_s"]) / case["measured_s"])
        assert case["predicted_s"] > 0 and case["predicted_known_lengths_s"] == case["predicted_s"]
    small, large = report["cases"]
    assert large["predicted_s"] > small["predicted_s"]      # 8 sequences cost more than one
    # the reference batch timed again on the validating engine, over the profile's time
    then = json.loads((out / "tiny-llama-s.tp1.fit.json").read_text())["reference_s"]
    for case in report["cases"]:
        assert case["reference_s"] > 0 and case["machine_vs_profile"] == pytest.approx(case["reference_s"] / then)
    assert report["machine_vs_profile"] == pytest.approx(small["machine_vs_profile"])


def test_validate_batches_smaller_than_the_reference_batch(small_profile, capsys):
    """One short request: the engine's KV budget still holds the reference batch timed
    after the cases (it once stopped there: 'needs 5 KV blocks, the engine has 1')."""
    from raycolo.cli.main import main

    out, _, stats = small_profile
    assert main(["validate", "--profile", str(out), "--models", stats["checkpoint"], "--name", "tiny-llama-s",
                 "--batches", "1", "--prompt-len", "8", "--output-len", "4", "--repeats", "1", "--json"]) == 0
    (case,) = json.loads(capsys.readouterr().out)["cases"]
    assert case["batch"] == 1 and case["reference_s"] > 0
    # and its batch limit takes the reference batch whole, as the profile's engine did
    from raycolo.offline.calibration import BatchRuns
    from raycolo.offline.profiler import REFERENCE_REQUESTS

    assert BatchRuns((1,), 8, 4).max_num_seqs() == REFERENCE_REQUESTS and BatchRuns((1, 64)).max_num_seqs() == 64


def test_validate_leaves_out_the_application_whose_models_have_no_profile(small_profile, capsys):
    """A directory with tiny-llama-s's profile only: the 2-model application (s answers,
    m judges) is not validated, since its plan would cost tiny-llama-m by roofline
    defaults; the progress line says so."""
    from raycolo.cli.main import main

    out, _, _ = small_profile
    assert main(["validate", "--profile", str(out), "--models", "tiny-llama-s", "--requests", "4",
                 "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    assert f"not validating the 2-model application: {out} has no profile of tiny-llama-m" in captured.err
    rows = [line.split()[0] for line in captured.out.splitlines()[1:] if line.startswith("tiny") or "DAG" in line]
    assert rows == ["tiny-llama-s"]


def test_validate_runs_the_request_sets_in_turn_across_the_cases(small_profile, capsys):
    """Set 1 of every case, then set 2 of every case: a slow minute of a shared machine
    falls on one set of several cases, not on both sets of one; the table gives each
    case's lowest and highest single-set error."""
    from raycolo.cli.main import main

    out, _, _ = small_profile
    assert main(["validate", "--profile", str(out), "--models", "tiny-llama-s", "--requests", "3",
                 "--repeats", "2"]) == 0
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("validating")]
    assert progress == ["validating tiny-llama-s (request set 1 of 2)", "validating tiny-llama-s (request set 2 of 2)"]
    row = next(line for line in captured.out.splitlines() if line.startswith("tiny-llama-s"))
    assert re.search(r"[+-]\d+%\.\.[+-]\d+%$", row) and "one set:" in captured.out


def test_a_profile_whose_machine_moved_says_so():
    from raycolo.offline.profiler import drift_warning, spread_warning

    assert spread_warning("m", 1.0) is None and spread_warning("m", 1.15) is None
    assert spread_warning("m", 1.3).startswith("m: warning:") and "30% longer" in spread_warning("m", 1.3)

    assert drift_warning("m", 1.0) is None and drift_warning("m", 1.09) is None and drift_warning("m", 0.91) is None
    assert "15% slower at the end" in drift_warning("m", 1.15)
    assert drift_warning("m", 0.8).startswith("m: warning:") and "20% faster" in drift_warning("m", 0.8)


def test_profile_dtype_and_the_gpu_sweep():
    from raycolo.offline.profiler import resolve_dtype

    assert resolve_dtype("tiny-llama-s", "cpu") == "float32"
    assert resolve_dtype("tiny-llama-s", "cuda") == "bfloat16"
    assert resolve_dtype("tiny-llama-s", "cuda", "float32") == "float32"     # asked for: kept
    gpu = SweepSettings.gpu()
    assert SweepSettings.for_run("cuda", quick=False) == gpu and SweepSettings.for_run("cpu", False) == SweepSettings()
    assert SweepSettings.for_run("cuda", quick=True) == SweepSettings.quick()
    # the engine takes the largest batch whole, and its KV holds it at the longest prompt
    assert gpu.max_num_seqs >= max(gpu.batch_sizes + gpu.sampler_batches)
    assert gpu.kv_cache_tokens >= max(gpu.batch_sizes) * (max(gpu.context_lens) + gpu.decode_steps)
    for settings in (SweepSettings(), SweepSettings.quick()):
        assert settings.max_num_seqs >= max(settings.batch_sizes)


def test_a_random_real_size_checkpoint_is_written_in_its_dtype(tmp_path):
    """bench/realsize_checkpoint.py (run on a lent GPU for the Llama-3-8B shape) on the tiny
    shape: a checkpoint transformers loads, in bfloat16, which a profile on CUDA takes as is."""
    from transformers import AutoModelForCausalLM

    from raycolo.offline.profiler import resolve_dtype

    out = tmp_path / "rs"
    subprocess.run([sys.executable, "bench/realsize_checkpoint.py", "--shape", "tiny", "--out", str(out),
                    "--device", "cpu", "--seed", "3"], check=True, capture_output=True, cwd=ROOT)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 2
    assert resolve_dtype(str(out), "cuda") == "bfloat16" and resolve_dtype(str(out), "cpu") == "float32"
    assert not (out / "tokenizer.json").exists()       # raycolo's byte tokenizer serves it


@pytest.mark.parametrize("argv,field", [
    (["profile", "--model", "nope"], "--model"),
    (["profile", "--model", "vicuna-13b-v1.5"], "--model"),
    (["profile", "--model", "tiny-llama-s", "--tp", "3"], "--tp"),     # 3 does not divide its 4 heads
    (["validate", "--profile", "/no/such/dir"], "--profile"),
    (["validate", "--models", "vicuna-13b-v1.5"], "--models"),
    (["validate", "--requests", "0"], "--requests"),
])
def test_profiling_cli_errors_name_the_field(argv, field):
    result = subprocess.run([sys.executable, "-m", "raycolo.cli", *argv], capture_output=True, text=True)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv,field", [
    (["profile", "--model", "tiny-llama-s", "--device", "cuda"], "--device"),    # this machine has none
    (["profile", "--model", "tiny-llama-s", "--dtype", "int8"], "--dtype"),
    (["validate", "--batches", "1,x"], "--batches"),
    (["validate", "--batches", "0"], "--batches"),
    (["validate", "--batches", "4", "--prompt-len", "0"], "--prompt-len"),
    (["validate", "--models", "llama-3-8b-instruct", "--batches", "1"], "--models"),
    (["validate", "--models", ".", "--batches", "1"], "--models"),        # a directory with no config.json
    (["validate", "--models", "tests"], "--models"),                      # a directory needs --batches
    (["validate", "--dtype", "bfloat16"], "--dtype"),                     # the sampled sets: float32 only
])
def test_profile_and_validate_refuse_bad_gpu_options_naming_the_flag(argv, field, capsys):
    """As the command line runs them (exit 2, one ``error:`` line), in this process."""
    from raycolo.cli.main import main

    try:
        rc = main(argv)
    except SystemExit as exc:      # the parser's own refusals
        rc = exc.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], lines


def test_profiled_engines_prefill_as_many_tokens_per_iteration_as_the_planner_simulates(tmp_path):
    """A Llama-3-8B-shaped config (context 8,192): the engine ``profile`` and ``validate``
    measure takes 8,192-token prefill iterations, as the planner's simulation does, and a
    tiny model keeps the 2,048 floor."""
    from raycolo.batching.limits import make_limits
    from raycolo.catalog import model_spec
    from raycolo.offline.profiler import engine_config

    ckpt = tmp_path / "llama3-8b"
    ckpt.mkdir()
    shape = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    (ckpt / "config.json").write_text(json.dumps(shape))
    for model, tokens in ((str(ckpt), 8192), ("tiny-llama-s", 2048)):
        planned = make_limits(model_spec(model), ClusterSpec(), 1).max_num_batched_tokens
        assert engine_config(model).engine_kwargs.max_num_batched_tokens == planned == tokens
