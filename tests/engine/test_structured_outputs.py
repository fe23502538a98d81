"""Structured outputs on the torch engine (raycolo.generation.structured, .grammar_masks):
greedy text under a JSON schema, a regex, choices, a grammar and ``json_object``, batched
with each other and with free rows, equals transformers' ``generate()`` under xgrammar's own
logits processor one request at a time (tests/support/constrained.py); the texts that end
parse and satisfy their constraint by Python's own ``json`` and ``re``; preemption and a
matcher cache too small to hold the batch (every step replays) change nothing."""
from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")      # a dependency of raycolo; absent on the GPU machines' own Python

from tests.support.constrained import constrained_reference  # noqa: E402
from tests.support.hf_checkpoints import load  # noqa: E402
from raycolo.engine import create_engine  # noqa: E402
from raycolo.generation import SamplingParams  # noqa: E402
from raycolo.generation.grammar_masks import GrammarMasks, allowed  # noqa: E402
from raycolo.generation.structured import StructuredOutputs  # noqa: E402
from raycolo.generation.vocab_rules import VocabRules  # noqa: E402

MAX_NEW = 32
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "n", "ok"], "additionalProperties": False}
REGEX = r"(yes|no), [a-z]{2,5}\."
CHOICES = ["river", "mountain", "the sea", "tab\there"]
CONSTRAINTS = [{"json": SCHEMA, "disable_any_whitespace": True}, {"regex": REGEX}, {"choice": CHOICES},
               {"grammar": 'root ::= "(" [0-9] ("+" [0-9])? ")"'}, {"json_object": True, "disable_any_whitespace": True},
               {"json": SCHEMA}]
PROMPTS = ["The river was quiet in the morning", "Where did the people go", "Tell me about São Paulo",
           "She made 42 words", "Look at the light", "One two three"]


def satisfied(constraint: dict, text: str) -> bool:
    """An independent check of a finished text: Python's json and re."""
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    if "choice" in constraint:
        return text in constraint["choice"]
    if "grammar" in constraint:
        return re.fullmatch(r"\([0-9](\+[0-9])?\)", text) is not None
    value = json.loads(text)
    if constraint.get("json_object"):
        return isinstance(value, dict)
    return (isinstance(value, dict) and set(value) == {"city", "n", "ok"} and isinstance(value["city"], str)
            and len(value["city"]) <= 5 and type(value["n"]) is int and 0 <= value["n"] <= 99 and type(value["ok"]) is bool)


@pytest.fixture(scope="module")
def engines(bpe_engines):
    return bpe_engines


def test_the_bitmask_is_xgrammars_layout():
    """allowed() reads the bits as xgrammar's own apply_token_bitmask_inplace does."""
    import xgrammar as xgr

    g = torch.Generator().manual_seed(0)
    for vocab in (31, 64, 1000):
        mask = torch.randint(-2 ** 31, 2 ** 31 - 1, xgr.get_bitmask_shape(3, vocab), generator=g, dtype=torch.int32)
        logits = torch.randn(3, vocab, generator=g)
        ref = logits.clone()
        xgr.apply_token_bitmask_inplace(ref, mask)
        assert torch.equal(logits.masked_fill(~allowed(mask, vocab), float("-inf")), ref)


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_greedy_constrained_text_equals_generate_under_xgrammar(kind, hf_checkpoints, engines, one_torch_thread):
    path, engine = hf_checkpoints[kind], engines[kind]
    tok = load(path)[1]
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    params = [SamplingParams(max_tokens=MAX_NEW, structured_outputs=StructuredOutputs(**c)) for c in CONSTRAINTS]
    free = SamplingParams(max_tokens=MAX_NEW)
    outs = engine.generate(prompts + prompts[:2], params + [free, free])      # one batch: constrained and free
    ended = 0
    for c, p, o in zip(CONSTRAINTS, prompts, outs):
        ids, reason = constrained_reference(path, p, c, MAX_NEW)
        assert o.token_ids == ids and o.finish_reason == reason, c
        if reason == "stop":
            ended += 1
            assert satisfied(c, o.text), (c, o.text)
    assert ended >= 4                              # the schema, regex, choice and grammar ones end on the tiny model
    free_outs = engine.generate(prompts[:2], free)
    assert [o.token_ids for o in outs[-2:]] == [o.token_ids for o in free_outs]


def test_preemption_and_a_cache_of_one_matcher_change_nothing(hf_checkpoints, engines, one_torch_thread):
    """Few KV blocks (requests preempted and re-prefilled) and a cache of one matcher (every
    row but one rebuilt and replayed from its output each step): the same tokens."""
    path = hf_checkpoints["llama3"]
    tok = load(path)[1]
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    params = [SamplingParams(max_tokens=MAX_NEW, structured_outputs=StructuredOutputs(**c)) for c in CONSTRAINTS]
    # and a constraint that binds after a token of the free output (a reasoning's end)
    frees = [o.token_ids for o in engines["llama3"].generate(prompts, SamplingParams(max_tokens=MAX_NEW))]
    k, j = next((i, j) for j, free in enumerate(frees) for i in range(3, len(free) - 2) if free[i] not in free[:i])
    free = frees[j]
    prompts.append(prompts[j])
    params.append(SamplingParams(max_tokens=MAX_NEW, structured_outputs=StructuredOutputs(**CONSTRAINTS[1]),
                                 structured_after_token=free[k]))
    want = [o.token_ids for o in engines["llama3"].generate(prompts, params)]
    assert want[-1][:k + 1] == free[:k + 1] and want[-1] != free
    small = create_engine({"model_loading_config": {"model_id": str(path)},
                           "engine_kwargs": {"kv_cache_tokens": 64, "block_size": 4}})
    try:
        vocab = int(small.model.config.vocab_size)
        small.rules = VocabRules(small.tokenizer, vocab, GrammarMasks(small.tokenizer, vocab, max_matchers=1))
        got = small.generate(prompts, params)
        assert [o.token_ids for o in got] == want
        assert sum(r.preempted for r in small.stats.iterations) > 0
        assert small.rules.grammar.rebuilt > 2 * len(prompts)
        assert len(small.rules.grammar.waiting) <= 1                     # bounded as the matchers are
    finally:
        small.release()


def test_a_constraint_after_a_token_binds_only_what_follows_its_first_occurrence(hf_checkpoints, engines,
                                                                                   one_torch_thread):
    """structured_after_token (a reasoning model's </think>: vLLM's grammar starts once the
    reasoning ends): the output is free up to and including the token's first occurrence,
    then constrained as transformers' generate() under xgrammar continues the same prefix.
    Here the token is the free output's 4th (a reasoning of 3 tokens), then </think> forced
    first by logit_bias (no reasoning), then a token that never comes (never constrained).
    One batch, with a row constrained from the start."""
    path, engine = hf_checkpoints["qwen2"], engines["qwen2"]
    tok = load(path)[1]
    close = tok.convert_tokens_to_ids("</think>")
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:4]]
    free = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))]
    json_c, regex_c = {"json": SCHEMA, "disable_any_whitespace": True}, {"regex": REGEX}
    k = next(i for i in range(3, MAX_NEW) if free[0][i] not in free[0][:i])
    assert close not in free[2]
    rows = [(json_c, dict(structured_after_token=free[0][k])),
            (regex_c, dict(structured_after_token=close, logit_bias={close: 100.0})),
            (json_c, dict(structured_after_token=close)),
            (json_c, {})]
    params = [SamplingParams(max_tokens=MAX_NEW, structured_outputs=StructuredOutputs(**c), **extra)
              for c, extra in rows]
    outs = engine.generate(prompts, params)
    prefix = free[0][:k + 1]
    ids, reason = constrained_reference(path, prompts[0] + prefix, json_c, MAX_NEW - len(prefix))
    assert outs[0].token_ids == prefix + ids and outs[0].finish_reason == reason
    ids, reason = constrained_reference(path, prompts[1] + [close], regex_c, MAX_NEW - 1)
    assert outs[1].token_ids == [close] + ids and outs[1].finish_reason == reason == "stop"
    assert outs[1].text == "</think>" + tok.decode(ids, skip_special_tokens=True)   # not special: in the text
    assert satisfied(regex_c, outs[1].text[len("</think>"):])
    assert outs[2].token_ids == free[2]
    assert (outs[3].token_ids, outs[3].finish_reason) == constrained_reference(path, prompts[3], json_c, MAX_NEW)
    with pytest.raises(ValueError, match="structured_after_token: only with structured_outputs"):
        SamplingParams(structured_after_token=close)


def test_seeded_draws_stay_inside_the_constraint(hf_checkpoints, engines, one_torch_thread):
    path, engine = hf_checkpoints["qwen2"], engines["qwen2"]
    prompt = load(path)[1]("Tell me")["input_ids"]
    for c in ({"regex": REGEX}, {"choice": CHOICES}):
        params = [SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=s,
                                 structured_outputs=StructuredOutputs(**c)) for s in range(8)]
        outs = engine.generate([prompt] * 8, params)
        assert all(o.finish_reason == "stop" and satisfied(c, o.text) for o in outs)
        assert len({o.text for o in outs}) > 1                      # they do draw
        again = engine.generate([prompt], params[3])[0]
        assert again.text == outs[3].text                            # seeded


def test_the_byte_tokenizer_of_a_tiny_catalog_model():
    engine = create_engine({"model_loading_config": {"model_id": "tiny-llama-s"},
                            "engine_kwargs": {"kv_cache_tokens": 2048}})
    try:
        params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputs(regex=r"[A-Z][a-z]{1,4}-[0-9]{2}"))
        outs = engine.generate(["Hello", "The city"], params)
        assert all(o.finish_reason == "stop" and re.fullmatch(r"[A-Z][a-z]{1,4}-[0-9]{2}", o.text) for o in outs)
    finally:
        engine.release()


def test_the_finished_grammar_allows_the_eos_set_and_stop_token_ids_as_vllm(hf_checkpoints):
    """vLLM gives the matcher the EOS set and the request's stop_token_ids, ignore_eos or not;
    an id past the vocabulary (the engine API does not check it) is left out, not a failure
    of the batch; a structured row without its request's key is refused."""
    from raycolo.engine.models import load_tokenizer
    from raycolo.generation.rows import SamplingRow

    path = hf_checkpoints["llama3"]
    tok, vocab = load_tokenizer(str(path)), load(path)[0].config.vocab_size
    rules = VocabRules(tok, vocab)
    done = tok.encode("A", add_special_tokens=False)
    stop = next(t for t in range(100, vocab) if t not in tok.eos_token_ids)
    for ignore_eos in (False, True):
        for extra in ((), (stop,), (stop, 10 ** 9)):
            params = SamplingParams(max_tokens=8, ignore_eos=ignore_eos, stop_token_ids=extra,
                                    structured_outputs=StructuredOutputs(regex="A"))
            row = SamplingRow.of(params, 0, done, key=("k", ignore_eos, extra))
            bitmask, live = rules.bitmask([row])
            allowed_ids = set(torch.nonzero(allowed(bitmask, vocab)[0]).flatten().tolist())
            assert live == [0] and allowed_ids == set(tok.eos_token_ids) | {t for t in extra if t < vocab}
    with pytest.raises(ValueError, match="key"):
        rules.bitmask([SamplingRow(SamplingParams(structured_outputs=StructuredOutputs(regex="A")), 0)])


def test_a_grammar_too_big_for_the_vocabulary_is_refused_by_size(hf_checkpoints):
    """The front's check (GrammarMasks.check_size): a compiled grammar over the limit is a
    ValueError naming its size; on this 2,048-id vocabulary [^"]{1,1000} takes 1.0 MiB,
    a JSON schema 0.5 MiB."""
    from raycolo.engine.models import load_tokenizer

    path = hf_checkpoints["llama3"]
    masks = GrammarMasks(load_tokenizer(str(path)), load(path)[0].config.vocab_size)
    big, small = StructuredOutputs(regex='[^"]{1,1000}'), StructuredOutputs(json=SCHEMA)
    with pytest.raises(ValueError, match="MiB for this model's vocabulary, over the 1 MiB"):
        masks.check_size(big, limit=1 << 20)
    masks.check_size(small, limit=1 << 20)
    masks.check_size(big)                                       # the default limit: 8 MiB
    assert masks.compile(big) is masks.compile(big)             # compiled once
