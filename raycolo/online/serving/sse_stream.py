"""The server-sent events of one streamed answer, with one choice or ``n``.

Each choice is an async iterator of :class:`~.responses.ChoiceEvent` (text delta,
finish_reason or None, tokens so far, log-probabilities, token ids, stop reason: the
ingress's per-request event stream). Each becomes
OpenAI's chunks under its own ``index`` (:class:`~.responses.SseChunks`), with vLLM's
``--stream-interval`` applied per choice (:class:`~.responses.StreamInterval`); a chat
opens every choice with its role, and its text may be read for reasoning and tool calls
(:class:`~.answer_reading.AnswerReader`, one per choice). With ``n`` > 1 the choices' chunks interleave as
their tokens come (each choice's own chunks in order), as OpenAI and vLLM stream them;
``usage`` (with ``stream_options.include_usage``) counts every choice's tokens. A choice
that fails ends the answer: the failure goes inside the stream (the 200 was sent), and
the other choices are cancelled with it. One choice is iterated directly, with no task
or queue between its events and its chunks (a streamed token's cost on the front).

Pure asyncio: no Ray.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Optional, Sequence, Union

from raycolo.generation import FinishReason
from raycolo.online.serving.openai_errors import OpenAIError
from raycolo.online.serving.responses import ChoiceEvent, SseChunks, StreamInterval, TokenFields
from raycolo.online.serving.answer_reading import AnswerReading


async def sse_answer(choices: Sequence[AsyncIterator], tokenizer, out_id: str, chat: bool, model: str,
                     prompt_tokens: int, include_usage: bool, stream_interval: int,
                     tokens: Union[TokenFields, Sequence[TokenFields]] = TokenFields(),
                     reading: Optional[AnswerReading] = None, echoed: str = "") -> AsyncIterator[str]:
    """The ``data:`` lines of the answer whose choices' events are ``choices``
    (:class:`~.responses.ChoiceEvent`, or its first four fields); ``tokens``: what the
    choices add about tokens (one for all, or one per choice: a completions batch's
    choices have their own prompts); ``reading``: how a chat's text is read for reasoning
    and tool calls (:mod:`.answer_reading`; None: it is not); ``echoed``: a chat's echo,
    the content every choice starts with (a chunk of its own after the role, as vLLM
    sends it)."""
    created = int(time.time())
    per_choice = [tokens] * len(choices) if isinstance(tokens, TokenFields) else list(tokens)
    tokens = per_choice[0]                  # whether token ids are asked: the same for every choice
    sses = [SseChunks(tokenizer, out_id, chat, model, created, index=i, tokens=per_choice[i])
            for i in range(len(choices))]
    held = [StreamInterval(stream_interval) for _ in choices]
    counts = [0] * len(choices)
    readers = [reading.reader() if reading is not None else None for _ in choices]
    if chat:
        for sse in sses:
            yield sse.chunk(None, None, role=True)
        for sse in sses if echoed else ():
            yield sse.chunk(echoed, None)
    # closed as soon as the loop ends (a failed choice cancels the others then, not when
    # the generator is collected)
    async with contextlib.aclosing(_indexed(choices[0]) if len(choices) == 1 else _merged(choices)) as events:
        async for i, event in events:
            ev = ChoiceEvent(*event)
            sse, counts[i] = sses[i], ev.count
            if not (ev.delta or ev.lps or ev.finish or tokens.asked):
                continue          # token ids alone (text held back, a stop token), not asked for: nothing to send
            if ev.finish == FinishReason.ERROR:       # after the 200: the failure travels inside the stream
                text, lps, ids = held[i].add("", ev.count, [], final=True, ids=ev.ids)
                if text or lps or (ids and tokens.asked):
                    yield sse.chunk(text, None, lps=lps, ids=ids)
                yield sse.error(OpenAIError(503, f"generation failed: {ev.delta}", code="generation_failed").body())
                break
            out = held[i].add(ev.delta, ev.count, ev.lps, final=ev.finish is not None, ids=ev.ids)
            if out is not None:
                text, lps, ids = out
                if readers[i] is None:          # the per-token path: no reader, nothing built
                    if text or lps or (ids and tokens.asked):
                        yield sse.chunk(text, None, lps=lps, ids=ids)
                else:
                    read = readers[i].feed(text)
                    if read.content or lps or (ids and tokens.asked) or read.calls or read.reasoning:
                        yield sse.chunk(read.content, None, lps=lps, ids=ids, calls=read.calls,
                                        reasoning=read.reasoning)
            if ev.finish:
                finish = ev.finish
                if readers[i] is not None:
                    read = readers[i].finish()
                    if read.content or read.calls or read.reasoning:
                        yield sse.chunk(read.content, None, calls=read.calls, reasoning=read.reasoning)
                    finish = reading.finish_reason(readers[i].called, finish)
                yield sse.chunk(None, finish, stop_reason=ev.stop_reason)
    if include_usage:
        yield sses[0].usage(prompt_tokens, sum(counts))
    yield SseChunks.DONE


async def _indexed(events: AsyncIterator):
    async with contextlib.aclosing(events):
        async for event in events:
            yield 0, event


_END = object()


async def _merged(choices: Sequence[AsyncIterator]):
    """``(index, event)`` of every choice as each comes; a choice's exception is raised
    here; leaving early (a failure, the client gone) cancels every choice still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, events: AsyncIterator) -> None:
        try:
            async for event in events:
                queue.put_nowait((i, event))
        except Exception as exc:       # noqa: BLE001 - raised in the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.get_running_loop().create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            i, event = await queue.get()
            if event is _END:
                running -= 1
            elif isinstance(event, Exception):
                raise event
            else:
                yield i, event
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
