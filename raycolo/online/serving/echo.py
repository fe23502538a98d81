"""What a choice shows of its prompt: OpenAI's ``echo`` and vLLM's ``prompt_logprobs``.

The prompt's log-probabilities come once, before the request's first token
(:mod:`raycolo.generation.prompt_scores` on the last stage); :func:`with_prompt` puts them on
the choice's first :class:`~.responses.ChoiceEvent`, so the non-streamed answer shows them
(``prompt_logprobs``) and, with ``echo``, the choice's first text and log-probabilities
start with the prompt's (vLLM's rules):

* the prompt's text is the text the request gave, or its token ids decoded (special tokens
  kept); with ``return_token_ids`` it is left out (vLLM shows the ids instead);
* with ``logprobs``, the prompt's tokens come first, the first of them without a
  log-probability (null in the answer);
* ``max_tokens: 0`` shows the prompt alone: the one token generated is counted and its
  id given where asked for, but neither its text nor its log-probability is shown.

Pure asyncio: no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Sequence

from raycolo.generation import FinishReason
from raycolo.online.serving.responses import ChoiceEvent


@dataclass(frozen=True)
class Echo:
    """What a completions choice shows of its prompt before its completion."""

    text: str                 # the prompt's text ("" with return_token_ids)
    ids: Sequence[int]        # the prompt's token ids
    logprobs: bool            # the choice's log-probabilities start with the prompt's
    alone: bool               # max_tokens 0: the prompt alone

    def first(self, ev: ChoiceEvent, prompt: Optional[list]) -> ChoiceEvent:
        """The choice's first event with its prompt before it (``prompt``: the prompt's
        log-probabilities; None entries are shown as the token alone)."""
        lps = ev.lps
        if self.logprobs:
            scored = prompt if prompt is not None else [None] * len(self.ids)
            lps = [tid if lp is None else lp for tid, lp in zip(self.ids, scored)] + list(ev.lps)
        return ev._replace(delta=self.text + ev.delta, lps=lps)


async def with_prompt(events: AsyncIterator, prompt: Callable[[], Optional[list]],
                      echo: Optional[Echo] = None) -> AsyncIterator[ChoiceEvent]:
    """``events`` (a choice's :class:`~.responses.ChoiceEvent`) with the prompt's
    log-probabilities (``prompt()``: what came, None if not asked) on the first, and what
    ``echo`` shows of the prompt (None: nothing)."""
    first = True
    async for ev in events:
        ev = ChoiceEvent(*ev)
        failed = ev.finish == FinishReason.ERROR
        if echo is not None and echo.alone and not failed:
            ev = ev._replace(delta="", lps=[])
        if first and not failed:
            first = False
            scored = prompt()
            ev = ev._replace(prompt=scored)
            if echo is not None:
                ev = echo.first(ev, scored)
        yield ev
