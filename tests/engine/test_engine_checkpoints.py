"""The embedded torch engine on checkpoints as users have them (tests/support/hf_checkpoints.py: a
Llama 3-style BPE tokenizer whose <|eot_id|> is an EOS only through generation_config.json,
a Qwen2 ChatML checkpoint, a GPT-2 one without a template), against transformers'
``generate()`` on the same directory: token ids, text and finish reasons, greedy."""
from __future__ import annotations

import pytest
import torch

from tests.support.hf_checkpoints import KINDS, greedy_cases, hf_reference, load
from raycolo.engine import create_engine
from raycolo.engine.models import load_tokenizer
from raycolo.generation import SamplingParams
from raycolo.online.serving.text import chat_prompt_ids, chat_sample_ids


MAX_NEW = 24


@pytest.fixture(scope="module")
def engines(hf_checkpoints):
    out = {kind: create_engine({"model_loading_config": {"model_id": str(path)},
                                "engine_kwargs": {"kv_cache_tokens": 8192}})
           for kind, path in hf_checkpoints.items()}
    yield out
    for e in out.values():
        e.release()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_transformers_generate(kind, hf_checkpoints, engines, one_torch_thread):
    path, engine = hf_checkpoints[kind], engines[kind]
    cases = greedy_cases(path, MAX_NEW, n=6)
    assert {c["finish_reason"] for c in cases} == {"stop", "length"}     # both paths run
    outs = engine.generate([c["prompt_ids"] for c in cases], SamplingParams(max_tokens=MAX_NEW))
    for c, o in zip(cases, outs):
        assert o.token_ids == c["output_ids"], c["prompt"]
        assert o.text == c["text"] and o.finish_reason == c["finish_reason"]
    if kind == "llama3":   # it stopped at <|eot_id|>, an EOS only through generation_config.json
        tok = load(path)[1]
        eot = tok.convert_tokens_to_ids("<|eot_id|>")
        assert eot != tok.eos_token_id and eot in load_tokenizer(str(path)).eos_token_ids
        assert any(o.token_ids[-1] == eot and o.finish_reason == "stop" for o in outs)
        assert min(tok.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>"])) > 1000


def test_a_qwen3_checkpoint_runs_on_the_fast_path_as_generate_does(qwen3_checkpoint, one_torch_thread):
    """Qwen3 (an RMSNorm of each head's query and key, head_dim 32 with hidden 64 and 4
    heads) on the paged executor, not the one-sequence fallback: transformers' tokens."""
    from raycolo.engine.executor import ModelExecutor

    engine = create_engine({"model_loading_config": {"model_id": str(qwen3_checkpoint)},
                            "engine_kwargs": {"kv_cache_tokens": 8192}})
    try:
        assert isinstance(engine.executor, ModelExecutor) and engine.executor.fused     # the fused steps too
        cases = greedy_cases(qwen3_checkpoint, MAX_NEW, n=6)
        assert {c["finish_reason"] for c in cases} == {"stop", "length"}
        outs = engine.generate([c["prompt_ids"] for c in cases], SamplingParams(max_tokens=MAX_NEW))
        for c, o in zip(cases, outs):
            assert o.token_ids == c["output_ids"] and o.finish_reason == c["finish_reason"], c["prompt"]
    finally:
        engine.release()


@pytest.mark.parametrize("kind", KINDS)
def test_text_prompts_are_encoded_as_the_tokenizer_does(kind, hf_checkpoints, engines):
    path, engine = hf_checkpoints[kind], engines[kind]
    case = [c for c in greedy_cases(path, MAX_NEW, n=6) if isinstance(c["prompt"], str)][0]
    out = engine.generate([case["prompt"]], SamplingParams(max_tokens=MAX_NEW))[0]
    assert out.prompt_token_ids == case["prompt_ids"] and out.token_ids == case["output_ids"]


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_chat_prompt_is_rendered_once(kind, hf_checkpoints):
    path = hf_checkpoints[kind]
    tok = load_tokenizer(str(path))
    messages = [("system", "Be brief."), ("user", "Where is the river?")]
    ids = chat_prompt_ids(tok, messages)
    hf = load(path)[1]
    ref = hf.apply_chat_template([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True,
                                 tokenize=True, return_dict=False)
    assert ids == list(ref)
    if hf.bos_token_id is not None:
        assert ids.count(hf.bos_token_id) == 1 and ids[0] == hf.bos_token_id
    # a chat training sample: the completion is the assistant's turn up to its end-of-turn token
    prompt, completion = chat_sample_ids(tok, [*messages, ("assistant", "By the stone.")], tok.eos_token_ids)
    assert prompt == ids
    end = "<|eot_id|>" if kind == "llama3" else "<|im_end|>"
    assert completion[-1] == hf.convert_tokens_to_ids(end)
    assert hf.decode(completion[:-1]).strip() == "By the stone."
    full = hf.apply_chat_template([{"role": r, "content": c} for r, c in [*messages, ("assistant", "By the stone.")]],
                                  tokenize=True, return_dict=False)
    assert list(full)[:len(prompt) + len(completion)] == prompt + completion


def test_repetition_penalty_equals_transformers(hf_checkpoints, engines):
    path, engine = hf_checkpoints["llama3"], engines["llama3"]
    model, tok = load(path)
    changed, prompts, refs = 0, [], []
    penalized = SamplingParams(max_tokens=20, repetition_penalty=3.0, ignore_eos=True)
    for text in ("The river was quiet in the morning", "the the the the the", "One two three", "It was very long"):
        prompt = tok(text)["input_ids"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, repetition_penalty=3.0,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        out = engine.generate([prompt], penalized)[0]
        assert out.token_ids == ref
        plain = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
        changed += plain.token_ids != ref
        prompts.append(prompt)
        refs.append(ref)
    assert changed      # the penalty changed something
    # one batch: the rows' histories kept on the device side by side, and dropped at the end
    assert [o.token_ids for o in engine.generate(prompts, penalized)] == refs
    assert len(engine.penalties) == 0 and engine.penalties.table.shape[0] == 0


def test_ignore_eos_runs_past_every_eos_id(hf_checkpoints, engines):
    path, engine = hf_checkpoints["llama3"], engines["llama3"]
    case = next(c for c in greedy_cases(path, MAX_NEW, n=6) if c["finish_reason"] == "stop")
    out = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == MAX_NEW
    assert out.token_ids[:len(case["output_ids"])] == case["output_ids"]
    ids, _, _ = hf_reference(path, case["prompt_ids"], MAX_NEW)
    assert ids == case["output_ids"]


def test_stop_string_and_logprobs(hf_checkpoints, engines):
    path, engine = hf_checkpoints["qwen2"], engines["qwen2"]
    case = next(c for c in greedy_cases(path, MAX_NEW, n=6) if c["finish_reason"] == "length")
    text = case["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    out = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=MAX_NEW, stop=[stop], logprobs=2))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(stop)]
    assert out.token_ids == case["output_ids"][:len(out.token_ids)]
    kept = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=MAX_NEW, stop=[stop],
                                                                include_stop_str_in_output=True))[0]
    assert kept.text == text[:text.index(stop) + len(stop)] and kept.token_ids == out.token_ids
    model = load(path)[0]
    with torch.no_grad():
        logits = model(torch.tensor([case["prompt_ids"] + out.token_ids])).logits[0].float()
    raw = torch.log_softmax(logits[len(case["prompt_ids"]) - 1:-1], -1)
    assert len(out.logprobs) == len(out.token_ids)
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(float(raw[i, lp.token]), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(raw[i], 2).indices.tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logprobs_are_transformers_log_likelihoods(kind, hf_checkpoints, engines, one_torch_thread):
    """vLLM's ``prompt_logprobs``: prompt token j's log-probability given the tokens before it
    (the first None), its rank and the top k, from transformers' logits over the whole prompt,
    in one prefill with prompts that do not ask (their tokens unchanged; preemption:
    tests/engine/test_engine.py). GPT-2 runs on the one-sequence fallback."""
    path, engine = hf_checkpoints[kind], engines[kind]
    cases = greedy_cases(path, MAX_NEW, n=6)[:3]
    model = load(path)[0]
    params = [SamplingParams(max_tokens=MAX_NEW, prompt_logprobs=k) for k in (3, None, 0)]
    outs = engine.generate([c["prompt_ids"] for c in cases], params)
    for c, o, p in zip(cases, outs, params):
        assert o.token_ids == c["output_ids"], c["prompt"]          # scoring changes no token
        if p.prompt_logprobs is None:
            assert o.prompt_logprobs is None
            continue
        ids = c["prompt_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        assert len(o.prompt_logprobs) == len(ids) and o.prompt_logprobs[0] is None
        for j, e in enumerate(o.prompt_logprobs[1:], 1):
            row = ref[j - 1]
            assert e.token == ids[j] and e.logprob == pytest.approx(float(row[ids[j]]), abs=1e-4)
            assert e.rank == int((row >= row[ids[j]] - 1e-6).sum())
            assert [t for t, _ in e.top] == torch.topk(row, p.prompt_logprobs).indices.tolist()
            assert [v for _, v in e.top] == pytest.approx(torch.topk(row, p.prompt_logprobs).values.tolist(),
                                                          abs=1e-4)


def test_online_refuses_a_family_its_pipeline_lacks_before_starting(hf_checkpoints, qwen3_checkpoint, tmp_path):
    """GPT-2 runs offline (the fallback path above) but not in the online pipeline: one
    error naming the field, before any cluster starts."""
    from raycolo.errors import ConfigError
    from raycolo.online.config import parse_online_config

    def config(kind):
        return parse_online_config({"model_loading_config": {"model_id": str(hf_checkpoints[kind])},
                                    "sample_store": str(tmp_path / "s"), "storage_path": str(tmp_path / "c")})

    config("llama3").check_paths()
    parse_online_config({"model_loading_config": {"model_id": str(qwen3_checkpoint)}, "sample_store": str(tmp_path / "s"),
                         "storage_path": str(tmp_path / "c")}).check_paths()          # Qwen3 has the fast path
    with pytest.raises(ConfigError, match=r"model_loading_config.model_id: .* 'gpt2' model"):
        config("gpt2").check_paths()


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "gpt2"])
def test_chat_preference_pairs_are_rendered_like_chat_samples(kind, hf_checkpoints):
    """A chat pair (messages ending with the user's turn, chosen, rejected): one prompt,
    each answer as the template writes an assistant turn; without a template, the plain
    template and the tokenizer's EOS."""
    path = hf_checkpoints[kind]
    tok = load_tokenizer(str(path))
    messages = [("user", "Where is the river?")]
    prompt, chosen, rejected = chat_sample_ids(tok, messages, tok.eos_token_ids, ["By the stone.", "Far away."])
    assert prompt == chat_prompt_ids(tok, messages)
    for answer, ids in (("By the stone.", chosen), ("Far away.", rejected)):
        assert (prompt, ids) == chat_sample_ids(tok, [*messages, ("assistant", answer)], tok.eos_token_ids)
        assert ids[-1] in tok.eos_token_ids | {tok.eos_token_id}
        assert load(path)[1].decode(ids[:-1]).strip() == answer
