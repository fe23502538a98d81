"""A step whose requests run on different adapter versions, as one pass (batched LoRA:
raycolo/online/stages/row_versions.py, raycolo/engine/executor/row_lora.py), against the
same stages running one pass per version (the path the existing variant tests check
against chains that hold only one version each)."""
from __future__ import annotations

import pytest
import torch

from raycolo.engine.models import build_tiny_model
from raycolo.online.stages.peft_format import export_adapter
from raycolo.online.stages.stage_model import LoraSettings, StageModel, add_lora, training_batch
from tests.engine.test_executor import random_prompts
from tests.online.test_stage import nonzero_lora, pipelined_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EVERY_PROJECTION = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def chain_of(dtype: str, lora: LoraSettings, batched: bool) -> list[StageModel]:
    out = []
    for first, last in ((0, 2), (2, 4)):
        model, _ = build_tiny_model("tiny-llama-m", 0, dtype)
        out.append(StageModel(add_lora(model, lora), (first, last), 64, 4, lr=lora.lr, batched_versions=batched))
    return out


def counted(chain: list[StageModel]) -> list[int]:
    """Count the executor passes of ``chain`` (one list entry per pass)."""
    passes: list[int] = []
    for st in chain:
        run = st.executor.execute

        def execute(*args, _run=run, **kw):
            passes.append(1)
            return _run(*args, **kw)
        st.executor.execute = execute
    return passes


# float32: the fused forward, gate/up fused; bfloat16: peft keeps the adapters in float32
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_mixed_versions_in_one_pass_equal_one_pass_per_version(tmp_path, dtype):
    """Rows pinned to a saved version (two of them), on the latest adapter, and on the base
    model, in one prefill and three decode steps through two stages: one pass per stage
    and step gives every row what three passes give, the latest weights stay as they were,
    and the versions really differ."""
    lora = LoraSettings(rank=4, alpha=8, lr=1e-2, seed=3, target_modules=EVERY_PROJECTION)
    one, per = chain_of(dtype, lora, True), chain_of(dtype, lora, False)
    nonzero_lora(one)
    for a, b in zip(one, per):
        b.load_lora_state(a.lora_state())
    v1 = export_adapter([st.lora_state() for st in one], lora, tmp_path / "v1")
    batch = training_batch([(p, p[1:7]) for p in random_prompts([9, 6], seed=8)])
    for chain in (one, per):              # the latest adapter moves away from v1, alike in both
        pipelined_step(chain, batch)
    latest = [st.lora_state() for st in one]
    rids, variants = [0, 1, 2, 3], {"base": [2], "pinned": {0: str(v1), 3: str(v1)}}
    passes_one, passes_per = counted(one), counted(per)

    def run(chain, toks, **kw):
        hidden = None
        for st in chain:
            hidden = st.forward(rids, toks, hidden, **kw)
        return hidden

    toks = random_prompts([7, 12, 5, 9], seed=4)
    tol = {"float64": 1e-10, "float32": 1e-4}.get(dtype)
    for step in range(4):
        got, ref = run(one, toks, **variants), run(per, toks, **variants)
        if tol is None:    # bf16: rows batched otherwise round otherwise; within 2-3 bf16 steps
            assert (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
        else:
            torch.testing.assert_close(got, ref, rtol=0, atol=tol)
            assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
        toks = [[int(t)] for t in ref.argmax(-1)]
    assert len(passes_one) == 2 * 4 and len(passes_per) == 2 * 4 * 3
    for st, before in zip(one, latest):
        for key, value in st.lora_state().items():
            assert torch.equal(value, before[key])


def test_versions_differ_so_the_check_can_fail(tmp_path):
    """The same step with every row on the latest adapter differs from the mixed one in
    the pinned and base rows (and equals it in the latest row)."""
    lora = LoraSettings(rank=4, alpha=8, lr=1e-2, seed=3, target_modules=EVERY_PROJECTION)
    chain = chain_of("float64", lora, True)
    nonzero_lora(chain)
    v1 = export_adapter([st.lora_state() for st in chain], lora, tmp_path / "v1")
    pipelined_step(chain, training_batch([(p, p[1:7]) for p in random_prompts([9, 6], seed=8)]))
    toks = random_prompts([7, 12, 5], seed=4)

    def run(rids, **kw):
        hidden = None
        for st in chain:
            hidden = st.forward(rids, toks, hidden, **kw)
        for st in chain:
            for r in rids:
                st.release(r)
        return hidden

    mixed = run([0, 1, 2], base=[2], pinned={0: str(v1)})
    plain = run([0, 1, 2])
    torch.testing.assert_close(mixed[1], plain[1], rtol=0, atol=1e-10)
    assert (mixed[0] - plain[0]).abs().max() > 1e-3 and (mixed[2] - plain[2]).abs().max() > 1e-3
