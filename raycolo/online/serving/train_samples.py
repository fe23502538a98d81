"""Training samples of POST /v1/train_samples and /v1/eval as token ids (pure: no Ray)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raycolo.online.serving.openai_errors import OpenAIError
from raycolo.online.serving.text import chat_sample_ids, encode_completion

if TYPE_CHECKING:
    from raycolo.online.serving.protocol import TrainSamplesBody


def sample_ids(tokenizer: Any, body: TrainSamplesBody, max_len: int) -> list[tuple[list[int], ...]]:
    """Each sample as token ids: (prompt, completion), or (prompt, chosen, rejected)."""
    out = []
    for i, s in enumerate(body.samples):
        if s.messages is not None:      # rendered with the chat template, once
            messages = [(m.role, m.text()) for m in s.messages]
            try:
                p_ids, *c_ids = chat_sample_ids(tokenizer, messages, tokenizer.eos_token_ids,
                                                [s.chosen, s.rejected] if s.is_pair else None)
            except ValueError as exc:
                raise OpenAIError(400, f"{body.param}[{i}].messages: {exc}", param=f"{body.param}[{i}].messages",
                                  code="invalid_parameter") from None
        else:
            prompt, *completions = (s.prompt, s.chosen, s.rejected) if s.is_pair else (s.prompt, s.completion)
            p_ids = tokenizer.encode(prompt)
            c_ids = [encode_completion(tokenizer, c) for c in completions]
        if len(p_ids) >= max_len:
            raise OpenAIError(400, f"{body.param}[{i}]: the prompt has {len(p_ids)} tokens; training "
                              f"samples hold at most lora.max_len = {max_len}", param=f"{body.param}[{i}]",
                              code="sample_too_long")
        out.append((p_ids, *c_ids))
    return out
