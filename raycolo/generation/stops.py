"""When a request stops, why, and what its output is: vLLM's stop checker.

* **The EOS set** of a checkpoint is the union of its tokenizer's EOS and every id of
  ``eos_token_id`` in ``generation_config.json`` (an int or a list: Llama 3 lists
  ``<|end_of_text|>`` and ``<|eot_id|>``), or of ``config.json`` where the checkpoint has
  no generation config (what ``transformers`` ``generate()`` and vLLM both read).
* **Stop tokens** are the EOS set (unless ``ignore_eos``) and ``stop_token_ids``.
* **Order of the checks** (vLLM v1's ``check_stop``, vllm/v1/core/sched/utils.py): a
  stop token first, then the length limit, so an EOS that is the ``max_tokens``-th token
  is a ``stop`` (as ``transformers`` sees it too); a stop token before ``min_tokens``
  tokens cannot happen (the sampler masks them) and is not a stop. A stop string (:mod:`.detokenize`) ends the output too.
* **Finish reason** (:class:`FinishReason`): ``stop`` (a stop token or string) or
  ``length``; the online server adds ``abort`` (the client went away) and ``error``.
* **Accounting**: every generated token counts, the stop token included, also when a
  stop string cut the text short (``usage.completion_tokens`` as vLLM counts it).
* **Text**: a stop token's text is never in the output; special tokens are left out
  with ``skip_special_tokens``; a stop string and what follows it are cut (what follows it only, with
  ``include_stop_str_in_output``); a character
  left incomplete at the end is dropped (:func:`.detokenize.finished_text`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

from raycolo.generation.detokenize import finished_text, text_stream
from raycolo.generation.params import SamplingParams
from raycolo.text_enum import TextEnum


class FinishReason(TextEnum):
    """Why a request ended (vLLM's ``FinishReason``, and the OpenAI ``finish_reason``)."""

    STOP = "stop"          # a stop token or a stop string
    LENGTH = "length"      # max_tokens, or the context
    ABORT = "abort"        # cancelled: its client went away
    ERROR = "error"        # it failed (the online server: its node or controller did)


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def eos_token_ids(tokenizer_eos: Optional[int], model_dir: Optional[str | Path] = None) -> frozenset[int]:
    """The EOS set: the tokenizer's EOS id and every id of ``eos_token_id`` in the
    checkpoint's ``generation_config.json`` (else ``config.json``)."""
    ids = set(_ids(tokenizer_eos))
    if model_dir is not None:
        for name in ("generation_config.json", "config.json"):
            path = Path(model_dir) / name
            if path.is_file():
                try:
                    data = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if isinstance(data, dict) and "eos_token_id" in data:
                    ids.update(_ids(data["eos_token_id"]))
                    break
    return frozenset(ids)


def stop_token_set(params: SamplingParams, eos_ids: Iterable[int]) -> frozenset[int]:
    """The token ids that end a request with these params."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_ids)
    return frozenset(ids)


def check_stop(params: SamplingParams, stop_ids: frozenset[int], output: Sequence[int]) -> Optional[FinishReason]:
    """Why a request whose output is ``output`` stops now (None: it goes on). ``stop_ids``:
    :func:`stop_token_set`."""
    n = len(output)
    if n and n > params.min_tokens and output[-1] in stop_ids:
        return FinishReason.STOP
    if n >= params.max_tokens:
        return FinishReason.LENGTH
    return None


def output_text(tokenizer, output: Sequence[int], stopped_by_token: bool, skip_special_tokens: bool = True,
                prompt_ids: Sequence[int] = ()) -> str:
    """The text of a finished output (no stop strings): the stop token left out."""
    ids = list(output[:-1]) if stopped_by_token else list(output)
    return finished_text(tokenizer, ids, prompt_ids, skip_special_tokens)


class StopChecker:
    """One request's stops, token by token: stop tokens, the length limit and (with a
    tokenizer) stop strings. ``append`` returns the finish reason once it stops."""

    def __init__(self, params: SamplingParams, eos_ids: Iterable[int], tokenizer=None,
                 prompt_ids: Sequence[int] = ()):
        self.params, self.prompt_ids = params, prompt_ids
        self.stop_ids = stop_token_set(params, eos_ids)
        self.output: list[int] = []
        self.finish_reason: Optional[FinishReason] = None
        self.stop_token: Optional[int] = None        # the stop token that ended it
        self.stream = text_stream(tokenizer, params, prompt_ids) if params.stop and tokenizer is not None else None
        self._text: list[str] = []

    def append(self, token: int) -> Optional[FinishReason]:
        if self.finish_reason is not None:
            raise RuntimeError("token after the request finished")
        self.output.append(int(token))
        reason = check_stop(self.params, self.stop_ids, self.output)
        if reason == FinishReason.STOP:
            self.stop_token = self.output[-1]    # its text is never output
        elif self.stream is not None:
            self._text.append(self.stream.add(token, check=len(self.output) > self.params.min_tokens))
            if self.stream.stopped is not None:
                reason = FinishReason.STOP
        self.finish_reason = reason
        return reason

    def text(self, tokenizer) -> str:
        """The output's text (after it finished)."""
        if self.stream is not None:
            return "".join(self._text) + self.stream.flush()
        return output_text(tokenizer, self.output, self.stop_token is not None, self.params.skip_special_tokens,
                           self.prompt_ids)
