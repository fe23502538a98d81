"""The realistic checkpoint fixtures (tests/support/hf_checkpoints.py) have the properties the serving tests rely on."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.support.hf_checkpoints import KINDS, SPECS, build_checkpoint, chat_prompt_ids, eos_ids, greedy_cases, hf_reference, load

FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json"}
TEXTS = ["Hello world", "café naïve über — 日本 東京 😀", "It's 2025! Where's the road?\n\n  two  spaces",
         "<|im_start|> and <|eot_id|> typed as text"]


def _n_ordinary(path: Path) -> int:
    return len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"])


def test_files_and_offline_load_with_auto_classes(hf_checkpoints):
    """A fresh interpreter, HF_HUB_OFFLINE=1 and sockets refused: Auto classes load all three and generate."""
    for kind, path in hf_checkpoints.items():
        assert FILES <= {f.name for f in path.iterdir()}, kind
    script = (
        "import socket, sys\n"
        "def refuse(*a, **k): raise OSError('network used')\n"
        "socket.socket.connect = refuse; socket.create_connection = refuse\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "for p in sys.argv[1:]:\n"
        "    m = AutoModelForCausalLM.from_pretrained(p); t = AutoTokenizer.from_pretrained(p)\n"
        "    ids = t('the river', return_tensors='pt').input_ids\n"
        "    out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3)\n"
        "    print(type(m).__name__, type(t).__name__, out.shape[1] > ids.shape[1])\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", script, *map(str, hf_checkpoints.values())], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[:3] == ["LlamaForCausalLM TokenizersBackend True",
                                          "Qwen2ForCausalLM Qwen2Tokenizer True", "GPT2LMHeadModel GPT2Tokenizer True"]


@pytest.mark.parametrize("kind", KINDS)
def test_special_ids_sit_above_the_ordinary_vocab(hf_checkpoints, kind):
    path = hf_checkpoints[kind]
    model, tok = load(path)
    n = _n_ordinary(path)
    assert n == SPECS[kind]["vocab"]
    specials = tok.convert_tokens_to_ids(SPECS[kind]["specials"])
    assert specials == list(range(n, n + len(specials)))  # appended right after the ordinary vocab, in order
    assert min(specials) >= n and tok.eos_token_id >= n and all(e >= n for e in eos_ids(path))
    added = tok.convert_tokens_to_ids(SPECS[kind].get("added", []))      # Qwen's <think>...: after the specials
    assert added == list(range(n + len(specials), n + len(specials) + len(added)))
    assert len(tok) == n + len(specials) + len(added) <= model.config.vocab_size
    if kind == "qwen2":
        assert model.config.vocab_size % 64 == 0 and model.config.vocab_size > len(tok)  # padded, as Qwen2's


@pytest.mark.parametrize("kind", KINDS)
def test_auto_tokenizer_matches_tokenizer_json(hf_checkpoints, kind):
    """Qwen2Tokenizer/GPT2Tokenizer rebuild their backend from vocab/merges: same ids as tokenizer.json."""
    path = hf_checkpoints[kind]
    tok, raw = load(path)[1], Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == raw.encode(text).ids
        if "<|" not in text:
            assert tok.decode(ids, skip_special_tokens=True) == text
        plain = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ([tok.bos_token_id] + plain if kind == "llama3" else plain)  # only llama3 adds a BOS


def test_eos_ids_come_from_generation_config(hf_checkpoints):
    ids = {k: load(p)[1].convert_tokens_to_ids for k, p in hf_checkpoints.items()}
    tok = {k: load(p)[1] for k, p in hf_checkpoints.items()}
    gen = {k: json.loads((p / "generation_config.json").read_text()) for k, p in hf_checkpoints.items()}
    assert gen["llama3"]["eos_token_id"] == [ids["llama3"]("<|end_of_text|>"), ids["llama3"]("<|eot_id|>")]
    assert tok["llama3"].eos_token_id == ids["llama3"]("<|end_of_text|>")  # <|eot_id|>: generation_config only
    assert tok["llama3"].bos_token_id == gen["llama3"]["bos_token_id"] == ids["llama3"]("<|begin_of_text|>")
    assert gen["qwen2"]["eos_token_id"] == [ids["qwen2"]("<|im_end|>"), ids["qwen2"]("<|endoftext|>")]
    assert tok["qwen2"].eos_token_id == ids["qwen2"]("<|im_end|>") and tok["qwen2"].bos_token_id is None
    assert gen["gpt2"]["eos_token_id"] == tok["gpt2"].eos_token_id == tok["gpt2"].bos_token_id == len(tok["gpt2"]) - 1
    assert all(g["do_sample"] is False for g in gen.values())


def test_chat_templates(hf_checkpoints):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there "}]
    llama, qwen = load(hf_checkpoints["llama3"])[1], load(hf_checkpoints["qwen2"])[1]
    assert llama.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = chat_prompt_ids(hf_checkpoints["llama3"], msgs)
    assert ids[0] == llama.bos_token_id and ids.count(llama.bos_token_id) == 1  # exactly one BOS
    newlines = llama("\n\n", add_special_tokens=False).input_ids
    assert ids[-2:] == [llama.convert_tokens_to_ids("<|end_header_id|>")] + newlines  # "\n\n" is one token
    assert qwen.apply_chat_template(msgs[1:], add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n Hi there <|im_end|>\n"
        "<|im_start|>assistant\n")
    ids = chat_prompt_ids(hf_checkpoints["qwen2"], msgs)
    assert ids[0] == qwen.convert_tokens_to_ids("<|im_start|>")  # no BOS at all
    assert qwen.convert_tokens_to_ids("<|endoftext|>") not in ids
    gpt2 = load(hf_checkpoints["gpt2"])[1]
    assert gpt2.chat_template is None
    with pytest.raises(ValueError):
        gpt2.apply_chat_template(msgs, add_generation_prompt=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_new_tokens", [16, 32])
def test_greedy_cases_stop_and_run_to_the_limit(hf_checkpoints, kind, max_new_tokens):
    path = hf_checkpoints[kind]
    tok = load(path)[1]
    tilted = tok.convert_tokens_to_ids(SPECS[kind]["tilt"])
    cases = greedy_cases(path, max_new_tokens)
    assert len(cases) == 6 and {c["finish_reason"] for c in cases} == {"stop", "length"}
    assert any(c["finish_reason"] == "stop" and len(c["output_ids"]) >= 4 for c in cases)
    for c in cases:
        out = c["output_ids"]
        assert (out[-1] == tilted) == (c["finish_reason"] == "stop")  # only the tilted EOS ever stops it
        assert len(out) == max_new_tokens if c["finish_reason"] == "length" else len(out) <= max_new_tokens
        assert not set(out[:-1]) & set(eos_ids(path))
        body = out[:-1] if c["finish_reason"] == "stop" else out
        full = tok.decode(body, skip_special_tokens=True)    # DecodeStream's text: a prefix, no half character
        assert full.startswith(c["text"]) and set(full[len(c["text"]):]) <= {"\ufffd"}
        assert hf_reference(path, c["prompt_ids"], max_new_tokens) == (out, c["text"], c["finish_reason"])
    if kind != "gpt2":
        assert tilted != tok.eos_token_id  # stops on generation_config's other EOS
        assert any(isinstance(c["prompt"], list) for c in cases) and any(isinstance(c["prompt"], str) for c in cases)
    pieces = [tok.decode([i]) for c in cases for i in c["output_ids"]]
    assert any(p.startswith(" ") for p in pieces)  # space-prefixed tokens
    assert any(any(ord(ch) > 127 for ch in p) for p in pieces)  # multi-byte (or partial UTF-8) tokens


@pytest.mark.parametrize("kind", KINDS)
def test_builds_are_deterministic(hf_checkpoints, tmp_path, kind):
    again = build_checkpoint(kind, tmp_path / "again", seed=0)
    for f in sorted(hf_checkpoints[kind].iterdir()):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    other = build_checkpoint(kind, tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() != (again / "tokenizer.json").read_bytes()
