"""Every catalog model plans, and every tiny one runs (tests/offline/test_runtime_adapt.py):
the catalog and the shipped output-length eCDFs stay in step. Three tiny models once had
none, and ``raycolo plan`` and ``run`` refused them before any work."""
import json

import pytest

from raycolo.catalog import ModelSpec, _builtin_catalog, get_model
from raycolo.cli.main import main
from raycolo.engine.models import MAX_RANDOM_PARAMS
from raycolo.errors import ConfigError
from raycolo.offline.costmodel.length_sampler import OutputLengthSampler, ecdf_path, load_ecdf

CATALOG = sorted(_builtin_catalog())
TINY = [m for m in CATALOG if get_model(m).hf_architecture and get_model(m).num_params <= MAX_RANDOM_PARAMS]


def test_every_catalog_model_has_its_ecdf():
    missing = [name for name in CATALOG if not ecdf_path(get_model(name).ecdf_name).exists()]
    assert not missing, f"no raycolo/data/ecdf/<name>.csv for {missing}: run tools/make_synthetic_ecdfs.py"
    for name in CATALOG:
        values, cdf = load_ecdf(str(ecdf_path(get_model(name).ecdf_name)))
        assert cdf[-1] == 1.0 and values.min() >= 1, name
    assert len(TINY) >= 6 and {"tiny-llama-xl", "tiny-qwen2-s", "tiny-mistral-s"} <= set(TINY)


def test_a_model_without_an_ecdf_is_told_how_to_make_one(tmp_path):
    """A model with no eCDF anywhere (here one outside the catalog, looked up in an empty
    profile directory): the error names the file and the command that writes it."""
    own = ModelSpec(name="my-model", layers=2, hidden=64, intermediate=128, heads=4, kv_heads=4, vocab=300,
                    context_length=512)
    with pytest.raises(ConfigError) as err:
        OutputLengthSampler(own, tmp_path)
    message = str(err.value)
    assert "my-model" in message and "my-model.csv" in message
    assert "raycolo profile --model my-model --out DIR" in message and "--profile DIR" in message


def _one_node(tmp_path, model):
    app = tmp_path / "app.yaml"
    app.write_text(f"""
name: one
requests: {{count: 12, input_tokens: {{distribution: uniform, min: 8, max: 64}}}}
nodes: [{{name: m, model: {model}, max_output_tokens: 32}}]
edges: [{{from: input, to: m}}]
""")
    return app


@pytest.mark.parametrize("model", CATALOG)
def test_every_catalog_model_plans_a_one_node_graph(model, tmp_path, capsys):
    """``raycolo plan`` of a one-node graph: the tiny models on the shipped CPU profiles
    (measured where there is one), the others on the roofline defaults."""
    args = ["plan", str(_one_node(tmp_path, model)), "--json"] + (["--profile", "cpu"] if model in TINY else [])
    assert main(args) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert plan["makespan_s"] > 0 and plan["node_finish_s"]["m"] == pytest.approx(plan["makespan_s"])
    assert {m["model"] for s in plan["stages"] for m in s["models"]} == {model}
    assert {c["model"] for c in plan["costed_from"]} == {model}
