"""``bad_words`` and ``allowed_token_ids`` (vLLM's) on the torch engine against transformers'
``generate()``: ``bad_words_ids`` (its NoBadWordsLogitsProcessor) with the token sequences
vLLM derives from the words (each word alone and after a space), and
``prefix_allowed_tokens_fn``; greedy, on BPE checkpoints, batched with free rows."""
from __future__ import annotations

import pytest
import torch

from tests.support.constrained import banned_word, vllm_sequences
from tests.support.hf_checkpoints import eos_ids, greedy_cases, load
from raycolo.generation import SamplingParams

MAX_NEW = 24


def reference(path, prompt_ids, **kw) -> list[int]:
    model, _ = load(path)
    prompt = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=eos_ids(path), pad_token_id=eos_ids(path)[0], **kw)
    return out[0, prompt.shape[1]:].tolist()


@pytest.fixture(scope="module")
def engines(bpe_engines):
    return bpe_engines


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_bad_words_ban_what_generate_bans(kind, hf_checkpoints, engines, one_torch_thread):
    path, engine = hf_checkpoints[kind], engines[kind]
    tok = load(path)[1]
    cases = [c for c in greedy_cases(path, MAX_NEW, n=6) if c["finish_reason"] == "length"][:2]
    prompts, params, refs = [], [], []
    for case in cases:
        words = [w for w in case["text"].split() if 1 < len(tok(w, add_special_tokens=False)["input_ids"]) < 4][:1]
        words.append(banned_word(tok, case["output_ids"]))     # the greedy answer takes it: the answer changes
        seqs = vllm_sequences(tok, words)
        ref = reference(path, case["prompt_ids"], bad_words_ids=seqs)
        assert ref != case["output_ids"]
        prompts.append(case["prompt_ids"])
        params.append(SamplingParams(max_tokens=MAX_NEW, bad_words=words))
        refs.append(ref)
    outs = engine.generate(prompts + prompts[:1], params + [SamplingParams(max_tokens=MAX_NEW)])
    assert [o.token_ids for o in outs[:-1]] == refs
    assert outs[-1].token_ids == cases[0]["output_ids"]          # the free row in the same batch is untouched
    for o, p in zip(outs, params):
        for seq in vllm_sequences(tok, p.bad_words):
            assert not any(o.token_ids[i:i + len(seq)] == seq for i in range(len(o.token_ids)))


def test_allowed_token_ids_restrict_as_prefix_allowed_tokens_fn(hf_checkpoints, engines, one_torch_thread):
    path, engine = hf_checkpoints["qwen2"], engines["qwen2"]
    case = greedy_cases(path, MAX_NEW, n=6)[0]
    vocab = load(path)[0].config.vocab_size
    allowed = sorted(set(range(5, vocab, 7)) - set(case["output_ids"][:3]) | set(eos_ids(path)))
    ref = reference(path, case["prompt_ids"], prefix_allowed_tokens_fn=lambda b, ids: allowed)
    out = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=MAX_NEW, allowed_token_ids=allowed))[0]
    assert out.token_ids == ref and set(ref) <= set(allowed)


def test_bad_word_bounds():
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["w"] * 65)
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ("a", "b")       # each once, in order
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
