"""The penalties' device-side history (raycolo/generation/penalty_history.py): a step reads
exactly the prompt and output its rows carry, whatever the history kept from earlier steps
(against the history built afresh, which tests/engine/test_generation.py checks against
transformers' processors, and against transformers directly)."""
from __future__ import annotations

import random

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from raycolo.engine.base import SamplingParams
from raycolo.generation.penalty_history import MIN_SLOTS, PROMPT_FLAG, PenaltyHistory
from raycolo.generation.rows import SamplingRow
from raycolo.generation.sampler import _upload, processed_logits, sample

P = SamplingParams
VOCAB = 50


def test_table_by_hand():
    """prompt [3, 3, 5, 60 (past the vocabulary)], output [5, 7, 7]: 3 and 5 flagged as
    prompt ids, 5 counted once and 7 twice; the next step adds only its new id."""
    h = PenaltyHistory(10)
    row = SamplingRow.of(P(max_tokens=9, repetition_penalty=1.2, frequency_penalty=0.5), 1, [5, 7, 7],
                         [3, 3, 5, 60], key="a")
    slots, arrays = h.plan([row])
    h.update(_upload(arrays, torch.int64, torch.device("cpu")))
    expected = [0] * 11
    expected[3], expected[5], expected[7], expected[10] = PROMPT_FLAG, PROMPT_FLAG + 1, 2, PROMPT_FLAG
    assert h.table[slots[0]].tolist() == expected
    assert h.mask(torch.tensor(slots)).tolist() == [[i in (3, 5, 7) for i in range(10)]]
    assert h.counts(torch.tensor(slots)).tolist() == [[1.0 if i == 5 else 2.0 if i == 7 else 0.0 for i in range(10)]]
    row = SamplingRow.of(row.params, 1, [5, 7, 7, 3], [3, 3, 5, 60], key="a")
    again, arrays = h.plan([row])
    assert again == slots and arrays["new_ids"].tolist() == [3] and not len(arrays["fresh_slots"])
    h.update(_upload(arrays, torch.int64, torch.device("cpu")))
    assert h.table[slots[0], 3] == PROMPT_FLAG + 1
    h.forget("a")
    assert len(h) == 0 and h.table.shape[0] == 0      # the last request gone: no memory held


def _decode(steps: int, seed: int):
    """Batches of a simulated decode: requests join and leave, grow one token a step,
    sometimes several (a resumed request), reuse a departed request's key with another
    prompt, come twice in one step, carry ids past the vocabulary, or carry no key."""
    rng = random.Random(seed)
    params = [P(max_tokens=99, repetition_penalty=1.5), P(max_tokens=99, presence_penalty=0.7, frequency_penalty=0.3),
              P(max_tokens=99, temperature=0.9, repetition_penalty=0.8, frequency_penalty=-0.2, top_p=0.9),
              P(max_tokens=99)]
    live: dict[int, list] = {}
    for _ in range(steps):
        for key in list(live):
            if rng.random() < 0.1:
                del live[key]
        while len(live) < 6 or rng.random() < 0.2:
            key = rng.randrange(12)            # keys come back: another request under an old key
            prompt = [rng.randrange(VOCAB + 3) for _ in range(rng.randrange(0, 9))]
            live[key] = [rng.choice(params), rng.randrange(3), prompt, [rng.randrange(VOCAB) for _ in range(rng.randrange(3))]]
        batch = []
        for key, (p, s, prompt, out) in live.items():
            out += [rng.randrange(VOCAB + 2) for _ in range(3 if rng.random() < 0.1 else 1)]
            if rng.random() < 0.3:
                batch.append(SamplingRow.of(p, s, list(out), prompt, key=key if rng.random() < 0.9 else None))
        if batch and batch[0].key is not None and rng.random() < 0.2:    # a key twice in one step,
            first = batch[0]                                               # the second one behind
            batch.append(SamplingRow.of(first.params, first.seed, first.output[:-1], first.prompt, key=first.key))
        yield batch


def test_kept_history_reads_what_the_rows_carry():
    h = PenaltyHistory()
    for step, rows in enumerate(_decode(120, seed=3)):
        if not rows:
            continue
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        kept = processed_logits(logits, rows, history=h)
        fresh = processed_logits(logits, rows)
        assert torch.equal(kept, fresh), step
        assert sample(logits, rows, history=h).tokens == sample(logits, rows).tokens
    assert 0 < h.table.shape[0] <= max(MIN_SLOTS, 2 * h.largest) * 2     # stale slots reused, not piled up


def test_repetition_over_steps_matches_transformers():
    """One request decoding 12 steps with a kept history: each step's penalized logits are
    transformers' RepetitionPenaltyLogitsProcessor over prompt + output."""
    p = P(max_tokens=99, repetition_penalty=1.7)
    prompt, out, h = [3, 5, 7, 5], [], PenaltyHistory()
    for step in range(12):
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(50 + step)) * 3
        row = SamplingRow.of(p, 0, list(out), prompt, key=7)
        theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + out]), logits.clone())
        assert torch.allclose(processed_logits(logits, [row], history=h), theirs), step
        out.append(sample(logits, [row], history=h).tokens[0])
    assert len(set(out)) > 6       # the penalty steers away from repeats


def test_refit_to_another_vocabulary_starts_over():
    h = PenaltyHistory()
    row = SamplingRow.of(P(max_tokens=9, presence_penalty=1.0), 0, [4, 4], key=1)
    a = processed_logits(torch.zeros(1, 8), [row], history=h)
    assert h.vocab == 8 and len(h) == 1
    b = processed_logits(torch.zeros(1, 16), [row], history=h)
    assert h.vocab == 16 and len(h) == 1 and h.table.shape[1] == 17
    assert a[0, 4] == b[0, 4] == -1.0


def test_a_key_reused_by_another_request_is_rebuilt():
    """What a slot remembers of its request (prompt length, seed, the last output id
    counted) tells a new request under the same key; each case differs in one of them."""
    p = P(max_tokens=9, repetition_penalty=2.0, presence_penalty=1.0)
    first = SamplingRow.of(p, 0, [1, 2], [5, 6], key="k")
    for other in (SamplingRow.of(p, 0, [1, 2, 3], [5, 6, 8], key="k"),     # another prompt length
                  SamplingRow.of(p, 9, [1, 2, 3], [5, 8], key="k"),        # another seed
                  SamplingRow.of(p, 0, [1, 4, 3], [5, 8], key="k")):       # another output so far
        h = PenaltyHistory()
        processed_logits(torch.ones(1, 10), [first], history=h)
        assert torch.equal(processed_logits(torch.ones(1, 10), [other], history=h),
                           processed_logits(torch.ones(1, 10), [other]))
