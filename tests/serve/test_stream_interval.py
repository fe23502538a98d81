"""vLLM's --stream-interval rule for streamed answers (raycolo/online/serving/responses.py), by hand."""
import pytest

from raycolo.online.serving.responses import StreamInterval


def _chunks(every, events, ids=False):
    """(text, log-probabilities) of each chunk sent, and its token ids with ``ids``
    (each event's ids: its log-probabilities' negatives)."""
    held, out = StreamInterval(every), []
    for delta, count, lps, final in events:
        got = held.add(delta, count, lps, final, ids=[-x for x in lps])
        if got is not None:
            out.append(got if ids else got[:2])
    return out


def test_every_arrival_is_a_chunk_at_interval_one():
    events = [("a", 1, [], False), ("b", 2, [], False), ("cd", 4, [], False), ("", 4, [], True)]
    assert _chunks(1, events) == [("a", []), ("b", []), ("cd", []), ("", [])]


def test_first_tokens_at_once_then_every_n_and_the_rest_at_the_end():
    # tokens 1..10 one by one, then the end: with 4, chunks after 1, 5, 9 and the end (10)
    events = [(str(i), i, [i], False) for i in range(1, 11)] + [("!", 10, [], True)]
    assert _chunks(4, events) == [("1", [1]), ("2345", [2, 3, 4, 5]), ("6789", [6, 7, 8, 9]), ("10!", [10])]
    assert [c[2] for c in _chunks(4, events, ids=True)] == [[-1], [-2, -3, -4, -5], [-6, -7, -8, -9], [-10]]


def test_tokens_arriving_together_count_as_many():
    # 3 tokens in one arrival after the first: 1 + 3 >= 1 + 3, so they go out at once
    events = [("a", 1, [], False), ("bcd", 4, [], False), ("e", 5, [], False), ("", 5, [], True)]
    assert _chunks(3, events) == [("a", []), ("bcd", []), ("e", [])]


def test_nothing_is_held_back_by_the_end():
    events = [(c, i + 1, [], False) for i, c in enumerate("hello world")] + [("", 11, [], True)]
    assert "".join(t for t, _ in _chunks(7, events)) == "hello world"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("model", ["tiny", "a\x00raycolo-text\x00b"])
def test_a_text_chunk_built_around_its_text_is_the_whole_chunk_encoded(chat, model):
    """The line a streamed token goes out in is encoded once per answer, its text alone
    per chunk: the same bytes as encoding the whole line, for any text (quotes, escapes,
    non-ASCII, NUL) and any model name (one holding the placeholder is built whole)."""
    import json

    from raycolo.online.serving.responses import SseChunks

    sse = SseChunks(None, "cmpl-7", chat, model, 1700000000)
    for text in ["hi", ' "quoted" \\ ', "é\n\x00\u2028", "\x00raycolo-text\x00"]:
        line = sse.chunk(text, None)
        assert line.startswith("data: ") and line.endswith("\n\n")
        body = json.loads(line[len("data: "):])
        choice = {"index": 0, "logprobs": None, "finish_reason": None,
                  **({"delta": {"content": text}} if chat else {"text": text})}
        assert body == {"id": "cmpl-7", "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": 1700000000, "model": model, "choices": [choice]}
        assert line == "data: " + json.dumps(body) + "\n\n"


# -- the answer's lines, one choice or n (raycolo/online/serving/sse_stream.py) -------------------
def _answer(choices, chat=False, include_usage=True, every=1, at_done=lambda: None):
    import asyncio
    import json

    from raycolo.online.serving.sse_stream import sse_answer

    async def run():
        lines = []
        async for line in sse_answer(choices, None, "cmpl-1", chat, "m", 5, include_usage, every):
            if line == "data: [DONE]\n\n":
                at_done()
            lines.append(line)
        return lines

    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


async def _choice(events, delays, log=None, name=None):
    """Events after the given delays (s); logs its own cancellation."""
    import asyncio

    try:
        for event, delay in zip(events, delays):
            await asyncio.sleep(delay)
            yield event
    except asyncio.CancelledError:
        log.append(name)
        raise


def test_n_choices_interleave_under_their_index_and_usage_counts_them_all():
    a = _choice([("He", None, 1, []), ("llo", None, 2, []), ("", "length", 2, [])], [0, 0.02, 0.02])
    b = _choice([("Yo", None, 1, []), ("", "stop", 2, [])], [0.01, 0.02])
    lines = _answer([a, b], chat=True)
    by_index = {0: [], 1: []}
    for line in lines[:-1]:
        (c,) = line["choices"]
        by_index[c["index"]].append(c)
    assert [c["delta"] for c in by_index[0][:1] + by_index[1][:1]] == [{"role": "assistant"}] * 2
    assert "".join(c["delta"].get("content", "") for c in by_index[0]) == "Hello"
    assert "".join(c["delta"].get("content", "") for c in by_index[1]) == "Yo"
    assert [c["finish_reason"] for c in by_index[0] if c["finish_reason"]] == ["length"]
    assert [c["finish_reason"] for c in by_index[1] if c["finish_reason"]] == ["stop"]
    contents = [(c["choices"][0]["index"], c["choices"][0]["delta"].get("content")) for c in lines[:-1]]
    assert contents.index((1, "Yo")) < contents.index((0, "llo"))    # as they came, not choice by choice
    assert lines[-1]["choices"] == [] and lines[-1]["usage"]["completion_tokens"] == 4


def test_a_failed_choice_ends_the_answer_and_cancels_the_others():
    cancelled = []
    a = _choice([("a", None, 1, []), ("b", None, 2, []), ("", "length", 3, [])], [0, 5, 5], cancelled, "a")
    b = _choice([("x", None, 1, []), ("node died", "error", 1, [])], [0.01, 0.01])
    seen_at_done = []
    lines = _answer([a, b], include_usage=False, at_done=lambda: seen_at_done.extend(cancelled))
    assert lines[-1]["error"]["code"] == "generation_failed" and "node died" in lines[-1]["error"]["message"]
    assert seen_at_done == ["a"]    # cancelled upstream before the answer ends (not when it is collected)
    assert not any(c["finish_reason"] for line in lines[:-1] for c in line["choices"])


def test_one_choice_streams_as_before():
    lines = _answer([_choice([("Hi", None, 1, []), ("", "stop", 2, [])], [0, 0])])
    assert [line["choices"][0]["text"] for line in lines[:-1]] == ["Hi", ""]
    assert all(line["choices"][0]["index"] == 0 for line in lines[:-1])
    assert lines[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
