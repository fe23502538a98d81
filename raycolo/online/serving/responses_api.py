"""A chat answer given in the shape of OpenAI's Responses API (``POST /v1/responses``;
the request: :mod:`.responses_protocol`).

* **Whole:** :func:`whole_response` turns the chat completion into a ``response``
  object. Its ``output`` lists a ``reasoning`` item (with a reasoning parser), a
  ``message`` item with one ``output_text`` part (unless the answer is calls alone), and
  one ``function_call`` item per call. ``status`` is ``completed``, or ``incomplete``
  with ``incomplete_details.reason: max_output_tokens`` when the limit cut the answer
  (and then its last item is ``incomplete`` too).
  ``usage`` counts ``input_tokens`` and ``output_tokens``.
* **Streamed:** :class:`ResponseEvents` turns the chat route's chunks into the Responses
  events, in OpenAI's order, each with its ``sequence_number``:
  1. ``response.created`` and ``response.in_progress``;
  2. for each item: ``response.output_item.added``, its ``response.content_part.added``
     (reasoning and messages), then its deltas (``response.reasoning_text.delta``,
     ``response.output_text.delta``, ``response.function_call_arguments.delta``), then
     their ``.done`` events, ``response.content_part.done`` and
     ``response.output_item.done``;
  3. ``response.completed`` (or ``response.incomplete``) with the whole response.

  A generation that fails after the 200 ends with ``response.failed``, its ``error``
  set.

Pure: no Ray.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Optional

from raycolo.online.serving.responses_protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(req: ResponsesRequest, rid: str, created: int, status: str, output: list,
                    usage: Optional[dict] = None, error: Optional[dict] = None) -> dict:
    """The ``response`` object (the request's settings given back, as OpenAI does)."""
    tool_choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {"format": {"type": "text"}}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0, "text": text,
            "tool_choice": tool_choice if tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "truncation": "disabled",
            "metadata": req.metadata or {}, "user": req.user, "usage": usage}


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def reasoning_item(iid: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": iid, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _part(kind: str, text: str) -> dict:
    """An item's content part: a message's output text, or reasoning text."""
    return text_part(text) if kind == "message" else {"type": "reasoning_text", "text": text}


def message_item(iid: str, text: Optional[str], status: str = "completed") -> dict:
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [text_part(text)] if text is not None else []}


def call_item(iid: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": iid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def whole_response(req: ResponsesRequest, answer: dict) -> dict:
    """The ``response`` object of a whole (non-streamed) chat ``answer``."""
    choice = answer["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning"):
        output.append(reasoning_item(new_id("rs"), message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (calls or output):      # an empty answer still has its message
        output.append(message_item(new_id("msg"), message.get("content") or ""))
    output += [call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    output[-1]["status"] = status            # the item the limit cut, as the stream closes it
    usage = answer["usage"]
    return response_object(req, new_id("resp"), answer["created"], status, output,
                           usage_of(usage["prompt_tokens"], usage["completion_tokens"]))


class ResponseEvents:
    """The Responses events of one streamed answer, from the chat route's chunks (see the
    module docstring): :meth:`events` wraps the chat route's ``data:`` lines."""

    def __init__(self, req: ResponsesRequest):
        self.req, self.rid, self.created = req, new_id("resp"), int(time.time())
        self.sequence = 0
        self.output: list[dict] = []     # the items done
        self.open: Optional[dict] = None  # the item being streamed: {"item", "kind", "text"}
        self.finish: Optional[str] = None
        self.usage: Optional[dict] = None

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _response(self, status: str, error: Optional[dict] = None) -> dict:
        return response_object(self.req, self.rid, self.created, status, list(self.output), self.usage, error)

    def _open(self, kind: str, item: dict) -> list[str]:
        out = self._close()
        self.open = {"kind": kind, "item": item, "text": ""}
        index = len(self.output)
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        if kind != "call":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_part(kind, "")))
        return out

    def _close(self, last: bool = False) -> list[str]:
        """The done events of the item being streamed, if any (``last``: the answer's last
        item, ``incomplete`` where the limit cut it)."""
        if self.open is None:
            return []
        kind, item, text = self.open["kind"], self.open["item"], self.open["text"]
        self.open, index, out = None, len(self.output), []
        status = "incomplete" if last and self.finish == "length" else "completed"
        if kind == "reasoning":
            item = reasoning_item(item["id"], text)
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text))
        elif kind == "message":
            item = message_item(item["id"], text)
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=[]))
        else:
            item = {**item, "arguments": text}
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=text))
        if kind != "call":
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=_part(kind, text)))
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out

    def _delta(self, kind: str, text: str) -> str:
        self.open["text"] += text
        item_id, index = self.open["item"]["id"], len(self.output)
        if kind == "reasoning":
            return self._event("response.reasoning_text.delta", item_id=item_id, output_index=index,
                               content_index=0, delta=text)
        if kind == "message":
            return self._event("response.output_text.delta", item_id=item_id, output_index=index,
                               content_index=0, delta=text, logprobs=[])
        return self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                           delta=text)

    def chunk(self, chunk: dict) -> list[str]:
        """The events one chat chunk gives."""
        out: list[str] = []
        if chunk.get("usage"):
            self.usage = usage_of(chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            for kind, text in (("reasoning", delta.get("reasoning")), ("message", delta.get("content"))):
                if text:
                    if self.open is None or self.open["kind"] != kind:
                        out += self._open(kind, reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning"
                                          else message_item(new_id("msg"), None, "in_progress"))
                    out.append(self._delta(kind, text))
            for call in delta.get("tool_calls") or ():
                if call.get("id") is not None:        # a new call: its id and name come with its first piece
                    fn = call.get("function") or {}
                    out += self._open("call", call_item(new_id("fc"), call["id"], fn.get("name", ""), "",
                                                        "in_progress"))
                arguments = (call.get("function") or {}).get("arguments")
                if arguments and self.open is not None and self.open["kind"] == "call":
                    out.append(self._delta("call", arguments))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    async def events(self, lines: AsyncIterator) -> AsyncIterator[str]:
        """The Responses events of the chat route's ``data:`` lines ``lines``."""
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))
        async for line in lines:
            text = line.decode() if isinstance(line, bytes) else line
            for data in (x[len("data: "):] for x in text.split("\n") if x.startswith("data: ")):
                if data.strip() == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:          # the generation failed after the 200
                    for event in self._close():
                        yield event
                    yield self._event("response.failed", response=self._response("failed", {
                        "code": "server_error", "message": chunk["error"].get("message", "generation failed")}))
                    return
                for event in self.chunk(chunk):
                    yield event
        if self.open is None and not self.output:      # an empty answer still has its message
            for event in self._open("message", message_item(new_id("msg"), None, "in_progress")):
                yield event
        for event in self._close(last=True):
            yield event
        status = "incomplete" if self.finish == "length" else "completed"
        yield self._event(f"response.{status}", response=self._response(status))
