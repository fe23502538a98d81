"""Text in: chat rendering and training samples as token ids.

* **Chat template.** A model whose tokenizer has a chat template renders messages with it
  (``apply_chat_template(..., add_generation_prompt=True)``), tokenized as the template
  wrote it: the template already holds the BOS token where the model wants one (Llama 3's
  ``<|begin_of_text|>``), so nothing is added (vLLM's chat route and ``transformers`` do
  the same: ``add_special_tokens=False``). Otherwise, including the tiny byte-tokenizer
  models and GPT-2-style checkpoints, raycolo's plain template is used, encoded as a
  prompt (with the tokenizer's own BOS, if it adds one)::

      <|system|>
      You are terse.
      <|user|>
      Hello
      <|assistant|>

  Each message is ``<|role|>\\n`` + its text + ``\\n``; the prompt ends with
  ``<|assistant|>\\n``. A chat whose last message is continued (``continue_final_message``,
  an assistant's prefill) ends with that message's text, without its ``\\n``; with a
  template, transformers' ``apply_chat_template(continue_final_message=True)`` cuts the
  rendered chat after the last message's text. With tools, the prompt opens with ``<|tools|>\\n`` + their
  JSON + ``\\n``; an assistant's tool calls follow its text, each as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the form the ``hermes``
  tool-call parser reads).
* **Training samples given as messages.** Every message but the last is the prompt,
  rendered as above; the last (the assistant's) is the completion, as the template
  renders an assistant turn: its text and the template's end-of-turn token
  (``<|eot_id|>``, ``<|im_end|>``), cut after the last token of the model's EOS set, so
  the loss falls only on the assistant's tokens and teaches the model where its turn
  ends. Without a template the completion ends with the tokenizer's EOS.
* Streaming text and stop strings: :mod:`raycolo.generation.detokenize`.
"""
from __future__ import annotations

import json
from typing import Iterable, Optional, Sequence, Union

from raycolo.generation.detokenize import TextStream  # noqa: F401  (the front streams with it)

PLAIN_TEMPLATE_ROLES = ("system", "developer", "user", "assistant", "tool")
Message = Union[tuple[str, str], dict]      # (role, text), or a message as a chat template takes it


def _as_dict(message: Message) -> dict:
    return {"role": message[0], "content": message[1]} if isinstance(message, tuple) else message


def _plain_turn(message: dict) -> str:
    calls = "".join("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                               ensure_ascii=False) + "</tool_call>"
                    for c in message.get("tool_calls") or ())
    return f"<|{message['role']}|>\n{message.get('content') or ''}{calls}\n"


def render_plain(messages: Sequence[Message], add_generation_prompt: bool = True,
                 tools: Optional[list[dict]] = None, continue_final_message: bool = False) -> str:
    text = f"<|tools|>\n{json.dumps(tools, ensure_ascii=False)}\n" if tools else ""
    text += "".join(_plain_turn(_as_dict(m)) for m in messages)
    if continue_final_message:          # the last message left open: no newline after its text
        return text[:-1]
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def _template_tokenizer(tokenizer):
    """The transformers tokenizer when it has a chat template, else None."""
    hf = getattr(tokenizer, "tok", None)
    return hf if hf is not None and getattr(hf, "chat_template", None) else None


class ChatTemplateError(ValueError):
    """The chat template refused a chat (its ``raise_exception``, or a variable it cannot
    use): the request's fault, a 400."""


def _apply(hf, messages: Sequence[Message], add_generation_prompt: bool, tokenize: bool,
           tools: Optional[list[dict]] = None, template_kwargs: Optional[dict] = None,
           continue_final_message: bool = False):
    from jinja2 import TemplateError

    chat = [_as_dict(m) for m in messages]
    try:
        out = hf.apply_chat_template(chat, tokenize=tokenize, tools=tools,
                                     add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message,
                                     **({"return_dict": False} if tokenize else {}), **(template_kwargs or {}))
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ChatTemplateError(f"the chat template cannot render this chat: {reason}") from None
    if tokenize and not isinstance(out, list):      # a BatchEncoding on some versions
        out = out["input_ids"]
    return list(out) if tokenize else out


def chat_prompt_ids(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: Optional[list[dict]] = None,
                    template_kwargs: Optional[dict] = None, continue_final_message: bool = False) -> list[int]:
    """A chat's prompt as token ids, rendered once: one BOS at most. ``add_special_tokens``
    (``/tokenize``'s): the tokenizer's special tokens on top of what the template wrote;
    raycolo's plain template is always encoded as a prompt, with them. ``tools``: the
    functions the model may call, as the template shows them (OpenAI's JSON);
    ``template_kwargs``: the request's ``chat_template_kwargs`` (checked:
    :func:`~.chat_messages.template_kwargs`; the plain template has no variables);
    ``continue_final_message``: the prompt ends inside the last message (see the module
    docstring)."""
    hf = _template_tokenizer(tokenizer)
    if hf is None:
        return tokenizer.encode(render_plain(messages, add_generation_prompt, tools, continue_final_message))
    how = {"tools": tools, "template_kwargs": template_kwargs, "continue_final_message": continue_final_message}
    if add_special_tokens:
        return tokenizer.encode(_apply(hf, messages, add_generation_prompt, tokenize=False, **how),
                                add_special_tokens=True)
    return _apply(hf, messages, add_generation_prompt, tokenize=True, **how)


def chat_sample_ids(tokenizer, messages: Sequence[tuple[str, str]], eos_ids: Iterable[int] = (),
                    completions: Optional[Sequence[str]] = None) -> tuple[list[int], ...]:
    """A chat training sample as ids: (prompt, completion), or (prompt, chosen, rejected)
    when ``completions`` gives the assistant's two answers to ``messages`` (a preference
    pair). Without ``completions`` the last message is the assistant's answer."""
    if completions is None:
        messages, completions = messages[:-1], [messages[-1][1]]
    prompt = chat_prompt_ids(tokenizer, messages)
    hf = _template_tokenizer(tokenizer)
    out = []
    for answer in completions:
        if hf is None:
            out.append(encode_completion(tokenizer, answer))
            continue
        full = _apply(hf, [*messages, ("assistant", answer)], False, tokenize=True)
        if full[:len(prompt)] != prompt:    # a template that renders history differently
            raise ValueError("the chat template renders the conversation's prompt differently once the "
                             "assistant's answer follows it; give prompt and completion instead")
        completion = full[len(prompt):]
        eos = set(eos_ids) | {getattr(tokenizer, "eos_token_id", None)}
        ends = [i for i, t in enumerate(completion) if t in eos]
        if ends:
            completion = completion[:ends[-1] + 1]    # ends with the end-of-turn token
        elif getattr(tokenizer, "eos_token_id", None) is not None:
            completion = completion + [tokenizer.eos_token_id]
        out.append(completion)
    return (prompt, *out)


def encode_completion(tokenizer, text: str) -> list[int]:
    """A training completion's ids: the text without a leading BOS, ending with EOS (so the
    adapter learns where an answer stops)."""
    hf = getattr(tokenizer, "tok", None)
    if hf is not None:
        ids = list(hf(text, add_special_tokens=False)["input_ids"])
    else:
        ids = tokenizer.encode(text)
        bos = getattr(tokenizer, "bos_token_id", None)
        if ids and ids[0] == bos:
            ids = ids[1:]
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids + ([eos] if eos is not None else [])
