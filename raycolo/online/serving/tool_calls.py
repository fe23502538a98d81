"""Tool calls read from a choice's text as it streams: one reader per choice, fed the text
deltas, giving the content to show and the calls, so a streamed answer and a whole one
are the same calls by construction (pure: no Ray, no torch).

What is read depends on the request's ``tool_choice`` (:class:`~.tool_protocol.ToolChoiceKind`):

* a **named** function: the whole text is the call's ``arguments`` (the text was
  constrained to its parameters' schema); streamed, the first delta names the function
  and the rest carry the arguments as they come. ``finish_reason`` stays the generation's
  (``stop``), as vLLM's and OpenAI's.
* **required**: the text is a JSON array of ``{"name", "parameters"}`` objects (also
  constrained); each call goes out once its object is complete. ``finish_reason`` is
  ``tool_calls`` when generation stopped.
* **auto**: the deployment's ``serve.tool_call_parser`` (:class:`ToolParserKind`) reads
  the model's own format; ``finish_reason`` is ``tool_calls`` once a call was read.

  - ``hermes`` (Hermes 2 Pro, Qwen 2.5 and 3, and raycolo's plain template):
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number. Text before
    the first call is the content; what could be the start of a ``<tool_call>`` tag is
    held back until it is clear. A call goes out when its tag closes; a block that is
    not a JSON object with a name, or that never closes, is shown as content instead.
    Text after the first call is not content (vLLM's rule).
  - ``llama3_json`` (Llama 3.1 to 3.3's JSON tool calling): a reply that begins (after
    whitespace and an optional ``<|python_tag|>``) with ``{`` is calls: JSON objects with
    ``name`` and ``arguments`` (or ``parameters``), separated by ``;``. It is held until
    the choice ends, then read whole: if any part is not such an object, the reply is
    content, as vLLM reads it.
  - ``pythonic`` (Llama 3.2 and 4, ToolACE): a reply that begins (after whitespace and an
    optional ``<|python_start|>``) with ``[`` is a Python list of calls with keyword
    arguments, ``[get_weather(city="Oslo"), get_time()]``, read whole when the choice
    ends; names are vLLM's (``[a-zA-Z]\\w*``: no dotted names) and arguments Python or
    JSON literals (``true``, ``null`` too). Anything else, positional arguments
    included, is content.
  - ``mistral`` (Mistral 7B Instruct v0.3, Nemo, Small 3.1, Magistral, Devstral): text
    before the first ``[TOOL_CALLS]`` is the content (what could begin the tag held
    back); what follows it is held until the choice ends and read whole, in either of
    Mistral's forms (:mod:`.tool_formats`). If it holds no call, it is content as it
    came, the tag included. Calls get ids of nine letters and digits, the only ids
    Mistral's templates take back in a conversation's history.
  - ``qwen3_coder`` (also ``qwen3_xml``: Qwen3-Coder, Qwen3.5): XML calls,
    ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``,
    each going out when its ``</function>`` arrives, its values typed by the tool's
    parameters schema (:mod:`.xml_tool_calls`). Text before the first call is content;
    a block that is not a call, or never closes, is content as it came.

The checkpoints' own tool-call tokens must be in the text: a tool-calling request is
detokenized with special tokens kept (vLLM's parsers ask the same).
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Optional

from raycolo.online.serving.tool_formats import (MISTRAL_TAG, PYTHON_TAG, call_object, llama3_calls, mistral_call_id,
                                                 mistral_calls, pythonic_calls)
from raycolo.online.serving.tool_protocol import ToolChoiceKind
from raycolo.online.serving.xml_tool_calls import XML_CALL_OPEN, XML_FUNCTION_CLOSE, XML_FUNCTION_OPEN, xml_call
from raycolo.text_enum import TextEnum


class ToolParserKind(TextEnum):
    """How ``tool_choice: auto`` reads calls from a model's text (vLLM's parser names)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    PYTHONIC = "pythonic"
    MISTRAL = "mistral"
    QWEN3_CODER = "qwen3_coder"
    QWEN3_XML = "qwen3_xml"          # vLLM's other name of the qwen3_coder parser


XML_PARSERS = (ToolParserKind.QWEN3_CODER, ToolParserKind.QWEN3_XML)


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    """A tool call's id (vLLM's form)."""
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


@dataclass
class CallDelta:
    """A piece of tool call ``index``: its id and name with its first piece, then
    arguments text."""

    index: int
    arguments: str
    id: Optional[str] = None
    name: Optional[str] = None

    def as_json(self) -> dict:
        """The streamed chunk's ``delta.tool_calls[]`` entry (OpenAI's)."""
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        function: dict = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclass
class ToolDelta:
    """What a piece of text gives: content to show and call pieces."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TextReader:
    """A reader of one choice's text: :meth:`feed` each delta, then :meth:`finish`; each
    returns what the text read so far gives (the subclass's ``_read``)."""

    text: str

    def feed(self, delta: str):
        self.text += delta
        return self._read(final=False)

    def finish(self):
        return self._read(final=True)

    def _read(self, final: bool):
        raise NotImplementedError


class ToolCallReader(TextReader):
    """One choice's text read for tool calls (see the module's doc): :meth:`feed` each
    text delta, then :meth:`finish`; each returns a :class:`ToolDelta`."""

    def __init__(self, kind: ToolChoiceKind, parser: Optional[ToolParserKind] = None,
                 function: Optional[str] = None, parallel: Optional[bool] = None, schemas: Optional[dict] = None):
        self.kind, self.parser, self.function = kind, parser, function
        self.schemas = schemas or {}     # the XML formats: each tool's parameters schema, by name
        self.limit = 1 if parallel is False else None       # parallel_tool_calls false: the first call only
        self.text = ""           # what came and is not read yet
        self.calls = 0           # calls read
        self.in_calls = False    # auto: past the content (the first call began)
        self.is_content = False  # llama3_json, pythonic: the reply was found to be content
        self.scanned = 0         # how much of text was searched or scanned already
        self.depth, self.in_string, self.escaped = 0, False, False     # required: the JSON scanner's state

    @property
    def called(self) -> bool:
        return self.calls > 0

    def _call(self, name: str, arguments: str) -> CallDelta:
        self.calls += 1
        new_id = mistral_call_id if self.parser == ToolParserKind.MISTRAL else call_id
        return CallDelta(self.calls - 1, arguments, new_id(), name)

    def _read(self, final: bool) -> ToolDelta:
        out = self._read_all(final)
        if self.limit is not None:          # vLLM drops the calls past the first, streamed or not
            out.calls = [c for c in out.calls if c.index < self.limit]
        return out

    def _read_all(self, final: bool) -> ToolDelta:
        if self.kind == ToolChoiceKind.NAMED:
            return self._named()
        if self.kind == ToolChoiceKind.REQUIRED:
            return ToolDelta(calls=self._array_items())
        if self.parser == ToolParserKind.HERMES:
            return self._hermes(final)
        if self.parser in WHOLE_REPLY_FORMATS:
            return self._whole_reply(final)
        if self.parser == ToolParserKind.MISTRAL:
            return self._mistral(final)
        if self.parser in XML_PARSERS:
            return self._xml(final)
        text, self.text = self.text, ""
        return ToolDelta(content=text)

    def _named(self) -> ToolDelta:
        """The whole text is the arguments: the first piece names the function."""
        text, self.text = self.text, ""
        if not self.calls:
            return ToolDelta(calls=[self._call(self.function, text)])
        return ToolDelta(calls=[CallDelta(0, text)] if text else [])

    # -- required: a JSON array of {"name", "parameters"} ------------------------------------
    def _array_items(self) -> list[CallDelta]:
        """Each object of the array once it closes: the new text is scanned once (string
        and nesting state kept), and an object is decoded once, when it is whole."""
        out = []
        while True:
            if self.depth == 0:
                rest = self.text.lstrip(" \t\r\n,[")
                if not rest.startswith("{"):
                    self.text, self.scanned = rest, 0
                    return out
                self.text, self.scanned = rest, 0
            end = self._scan_object()
            if end is None:
                return out
            body, self.text, self.scanned = self.text[:end], self.text[end:], 0
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError):
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                out.append(self._call(obj["name"], json.dumps(obj.get("parameters", {}), ensure_ascii=False)))

    def _scan_object(self) -> Optional[int]:
        """Where the object ``self.text`` begins with ends (None: not yet), scanning only
        what was not scanned before."""
        for i in range(self.scanned, len(self.text)):
            c = self.text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        self.scanned = len(self.text)
        return None

    # -- hermes -----------------------------------------------------------------------------
    def _hermes(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        while True:
            if not self.in_calls:
                at = self.text.find(HERMES_OPEN)
                if at < 0:
                    keep = 0 if final else held_prefix(self.text, HERMES_OPEN)
                    out.content += self.text[:len(self.text) - keep]
                    self.text = self.text[len(self.text) - keep:]
                    return out
                out.content += self.text[:at]
                self.text, self.in_calls = self.text[at:], True
            start = self.text.find(HERMES_OPEN)
            if start < 0:            # between calls: text there is no content (vLLM's rule)
                keep = 0 if final else held_prefix(self.text, HERMES_OPEN)
                self.text = self.text[len(self.text) - keep:]
                return out
            end = self.text.find(HERMES_CLOSE, max(start, self.scanned - len(HERMES_CLOSE)))
            if end < 0:
                self.scanned = len(self.text)      # the next search starts near here
                if final:            # a call that never closed: shown as it came
                    out.content += self.text[start:]
                    self.text, self.scanned = "", 0
                return out
            block = self.text[start:end + len(HERMES_CLOSE)]
            self.text, self.scanned = self.text[end + len(HERMES_CLOSE):], 0
            call = call_object(block[len(HERMES_OPEN):-len(HERMES_CLOSE)])
            if call is None:
                out.content += block
            else:
                out.calls.append(self._call(*call))

    # -- mistral: content, then calls after [TOOL_CALLS], read whole -----------------------
    def _mistral(self, final: bool) -> ToolDelta:
        """Content until the first ``[TOOL_CALLS]`` (what could begin it held back); from
        there on the text is held and read whole when the choice ends: its calls, or, if
        it holds none, content as it came."""
        out = ToolDelta()
        if not self.in_calls:
            at = self.text.find(MISTRAL_TAG)
            if at < 0:
                keep = 0 if final else held_prefix(self.text, MISTRAL_TAG)
                out.content, self.text = self.text[:len(self.text) - keep], self.text[len(self.text) - keep:]
                return out
            out.content, self.text, self.in_calls = self.text[:at], self.text[at:], True
        if final:
            text, self.text = self.text, ""
            calls = mistral_calls(text)
            if calls is None:
                out.content += text
            else:
                out.calls = [self._call(*c) for c in calls]
        return out

    # -- qwen3_coder: <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function> --
    def _xml(self, final: bool) -> ToolDelta:
        """Content until the first ``<tool_call>`` or bare ``<function=`` (what could begin
        either held back); a call goes out when its ``</function>`` arrives
        (:func:`~.xml_tool_calls.xml_call`); a block that is not a call, or whose
        ``<function=`` never closes, is shown as content as it came (from its
        ``<tool_call>``); other text after the first call, and a ``<tool_call>`` that
        never opens a function, are not content (as vLLM reads them)."""
        out = ToolDelta()
        while True:
            if not self.in_calls:
                found = [i for i in (self.text.find(XML_CALL_OPEN), self.text.find(XML_FUNCTION_OPEN)) if i >= 0]
                if not found:
                    keep = 0 if final else max(held_prefix(self.text, XML_CALL_OPEN),
                                               held_prefix(self.text, XML_FUNCTION_OPEN))
                    out.content, self.text = self.text[:len(self.text) - keep], self.text[len(self.text) - keep:]
                    return out
                out.content, self.text, self.in_calls = self.text[:min(found)], self.text[min(found):], True
            start = self.text.find(XML_FUNCTION_OPEN)
            if start < 0:          # between calls: no content; kept from the last <tool_call> (or what could begin one)
                opened = self.text.rfind(XML_CALL_OPEN)
                keep = 0 if final else len(self.text) - opened if opened >= 0 else max(
                    held_prefix(self.text, XML_CALL_OPEN), held_prefix(self.text, XML_FUNCTION_OPEN))
                self.text, self.scanned = self.text[len(self.text) - keep:], 0
                return out
            opened = self.text.rfind(XML_CALL_OPEN, 0, start)
            shown = opened if opened >= 0 else start      # a block shown as content: from its <tool_call>
            end = self.text.find(XML_FUNCTION_CLOSE, max(start, self.scanned - len(XML_FUNCTION_CLOSE)))
            if end < 0:
                self.scanned = len(self.text)
                if final:          # a call that never closed: shown as it came
                    out.content += self.text[shown:]
                    self.text, self.scanned = "", 0
                return out
            end += len(XML_FUNCTION_CLOSE)
            block, self.text, self.scanned = self.text[:end], self.text[end:], 0
            call = xml_call(block[start:], self.schemas)
            if call is None:
                out.content += block[shown:]
            else:
                out.calls.append(self._call(*call))

    # -- llama3_json, pythonic: a reply that is calls, read whole --------------------------
    def _whole_reply(self, final: bool) -> ToolDelta:
        """A reply that begins (after whitespace and the format's optional tag) with the
        format's opening character is held and read whole when the choice ends; any
        other reply streams as content."""
        tag, opening, read = WHOLE_REPLY_FORMATS[self.parser]
        if self.is_content:           # decided: the rest of the reply is content too
            text, self.text = self.text, ""
            return ToolDelta(content=text)
        if not self.in_calls:
            head = self.text.lstrip()
            if head.startswith(tag):
                head = head[len(tag):].lstrip()
            if head.startswith(opening):
                self.in_calls = True
            elif final or (head and not tag.startswith(head)):
                self.is_content = True
                text, self.text = self.text, ""
                return ToolDelta(content=text)
            else:
                return ToolDelta()        # too early to tell
        if not final:
            return ToolDelta()
        text, self.text = self.text, ""
        body = text.strip()
        body = body[len(tag):] if body.startswith(tag) else body
        calls = read(body)
        if calls is None:
            return ToolDelta(content=text)
        return ToolDelta(calls=[self._call(*c) for c in calls])


# the formats read whole: (optional opening tag, first character of a call, reader)
WHOLE_REPLY_FORMATS = {ToolParserKind.LLAMA3_JSON: (PYTHON_TAG, "{", llama3_calls),
                       ToolParserKind.PYTHONIC: ("<|python_start|>", "[", pythonic_calls)}


@dataclass(frozen=True)
class ToolReading:
    """How a request's choices are read for tool calls (None where ``tool_choice`` is none)."""

    kind: ToolChoiceKind
    parser: Optional[ToolParserKind] = None
    function: Optional[str] = None       # the named function's
    parallel: Optional[bool] = None      # parallel_tool_calls (false: the first call only)
    schemas: Optional[dict] = None       # the XML formats: each tool's parameters schema, by name

    def reader(self) -> ToolCallReader:
        return ToolCallReader(self.kind, self.parser, self.function, self.parallel, self.schemas)

    def finish_reason(self, called: bool, finish: Optional[str]) -> Optional[str]:
        """The choice's ``finish_reason``: ``tool_calls`` where auto read a call or a
        required call stopped (vLLM's and OpenAI's rule), else the generation's."""
        if called and (self.kind == ToolChoiceKind.AUTO or (self.kind == ToolChoiceKind.REQUIRED
                                                            and finish == "stop")):
            return "tool_calls"
        return finish


@dataclass
class ToolAnswer:
    """A whole choice read for tool calls: its content and calls (OpenAI's message fields)."""

    content: Optional[str]
    tool_calls: list[dict]

    @property
    def called(self) -> bool:
        return bool(self.tool_calls)


def join(deltas: list) -> tuple[str, list[dict]]:
    """The content and whole calls (OpenAI's ``message.tool_calls``) of a choice's deltas."""
    content, calls = "", []
    for d in deltas:
        content += d.content
        for c in d.calls:
            if c.index == len(calls):
                calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
            calls[c.index]["function"]["arguments"] += c.arguments
    return content, calls


def answer_content(kind: ToolChoiceKind, content: Optional[str], calls: list) -> Optional[str]:
    """A whole answer's content beside its calls: the text outside them; where there is
    none, ``""`` for a forced call (vLLM's) and None when the model called on its own
    (OpenAI's)."""
    if calls and not content:
        return "" if kind != ToolChoiceKind.AUTO else None
    return content


def read_whole(reader: ToolCallReader, text: str) -> ToolAnswer:
    """A non-streamed choice's ``text`` read as the stream would read it."""
    content, calls = join([reader.feed(text), reader.finish()])
    return ToolAnswer(answer_content(reader.kind, content, calls), calls)
