"""Token texts in log-probabilities as vLLM 0.32 shows them (raycolo.online.serving.token_texts),
on the byte-level BPE checkpoints of tests/support/hf_checkpoints.py: a character split over
byte tokens shows "" on each token before its last and the whole character on the last, so
a sequence's token texts join to its text; a token alone decodes as itself."""
from __future__ import annotations

import pytest

from raycolo.online.serving.token_texts import REPLACEMENT, TokenTexts
from tests.support.hf_checkpoints import load


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
@pytest.mark.parametrize("text", ["A parrot 🦜 and a flamingo 🦩", "₿ 𝔘𝔫𝔦 ẞ", "plain words only"])
def test_a_sequences_token_texts_join_to_its_text(kind, text, hf_checkpoints):
    tok = load(hf_checkpoints[kind])[1]
    ids = tok.encode(text, add_special_tokens=False)
    texts = TokenTexts(tok)
    shown = []
    for t in ids:
        shown.append(texts.at([t], prompt=False)[0])
        texts.advance(t)
    assert "".join(shown) == tok.decode(ids)
    split = [t for t in ids if tok.decode([t]).endswith(REPLACEMENT)]
    assert bool(split) == (text != "plain words only")        # the case is what it says
    assert "" in shown if split else shown == [tok.decode([t]) for t in ids]
    # alternatives at a position decode in the sequence's context; a new sequence starts afresh
    fresh = [tok.decode([t]) for t in (ids[0], ids[-1])]       # no context: an incomplete character shows ""
    assert TokenTexts(tok).at([ids[0], ids[-1]], prompt=True) == ["" if x.endswith(REPLACEMENT) else x for x in fresh]
    texts.at([ids[0]], prompt=True)             # the prompt's sequence is another: its context starts empty
    assert texts.context == []
    assert TokenTexts(tok, as_ids=True).at([ids[0]], prompt=False) == [f"token_id:{ids[0]}"]
    offsets = TokenTexts(tok)
    assert [offsets.place(s) for s in ["ab", "", "c"]] == [0, 2, 2] and offsets.place("d") == 3
