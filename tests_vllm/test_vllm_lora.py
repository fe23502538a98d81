"""vLLM loads the adapters raycolo exports (opt-in: ``make test-vllm``).

Every adapter version raycolo trains is written in peft's format by
``raycolo.online.stages.peft_format.export_adapter`` (the stage workers' LoRA weights, joined).
Here the main venv (which has peft) builds the Llama 3-style checkpoint, gives two stages
random LoRA weights, exports them and records ``PeftModel``'s greedy tokens; vLLM, from
.venv-vllm, loads the same directory with a ``LoRARequest`` and must generate the same
tokens (and other tokens without the adapter).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parent.parent
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
NEW = 12

EXPORT = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    import torch
    sys.path.insert(0, "tests/support")
    from hf_checkpoints import build_checkpoint, load
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from raycolo.online.stages.peft_format import export_adapter
    from raycolo.online.stages.stage_model import LoraSettings, StageModel, add_lora

    out = Path(sys.argv[1])
    ckpt = build_checkpoint("llama3", out / "ckpt", seed=0, hidden_size=128)
    lora = LoraSettings(rank=8, alpha=16, lr=1e-2, seed=3)
    base = lambda: AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    torch.manual_seed(0)
    chain = []
    for bounds in ((0, 1), (1, 2)):
        stage = StageModel(add_lora(base(), lora), bounds, 64, 16, lr=lora.lr)
        with torch.no_grad():
            for name, p in stage.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.2)
        chain.append(stage)
    adapter = export_adapter([s.lora_state() for s in chain], lora, out / "adapter")
    peft = PeftModel.from_pretrained(base(), str(adapter)).eval()
    tok = load(ckpt)[1]
    prompts = [tok(t)["input_ids"] for t in ("The river was quiet", "Look at the light", "One two three")]
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = peft.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist()
            refs.append(ids)
    (out / "refs.json").write_text(json.dumps({"ckpt": str(ckpt), "adapter": str(adapter),
                                               "prompts": prompts, "refs": refs}))
''').replace("NEW", str(NEW))


def test_vllm_generates_what_peft_does_with_raycolos_exported_adapter(tmp_path):
    if not MAIN_PYTHON.exists():
        pytest.fail(f"{MAIN_PYTHON} is missing: run make test first (the export needs peft)")
    proc = subprocess.run([str(MAIN_PYTHON), "-c", EXPORT, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((tmp_path / "refs.json").read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=data["ckpt"], enable_lora=True, max_lora_rank=8, max_loras=1, dtype="float32",
              max_model_len=512, block_size=32, seed=0, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in data["prompts"]]
    with_adapter = llm.generate(prompts, params, lora_request=LoRARequest("raycolo", 1, data["adapter"]))
    without = llm.generate(prompts, params)
    got = [list(o.outputs[0].token_ids) for o in with_adapter]
    assert got == data["refs"]
    assert [list(o.outputs[0].token_ids) for o in without] != data["refs"]     # the adapter matters
