"""References for the sampling rules that need the tokenizer. Structured outputs:
transformers' greedy ``generate()`` with xgrammar's
own transformers logits processor (``xgrammar.contrib.hf``), the grammar compiled the way
vLLM's xgrammar backend compiles each kind (``compile_json_schema``, ``compile_regex``,
``compile_grammar``), one request at a time: no batching, no matcher cache, no replay.
``bad_words``: the token sequences vLLM bans (:func:`vllm_sequences`), for ``generate()``'s
``bad_words_ids``."""
from __future__ import annotations

import torch

from tests.support.hf_checkpoints import eos_ids, load

CHOICE_ESCAPES = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}


def compiled(path, constraint: dict):
    """``constraint`` (vLLM's structured_outputs fields) compiled for checkpoint ``path``."""
    import xgrammar as xgr

    model, tok = load(path)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size, stop_token_ids=eos_ids(path))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compact = constraint.get("disable_any_whitespace", False)
    ws = dict(any_whitespace=not compact, separators=(",", ":") if compact else None)
    if "json" in constraint:
        return compiler.compile_json_schema(constraint["json"], **ws)
    if constraint.get("json_object"):
        return compiler.compile_json_schema('{"type": "object"}', **ws)
    if "regex" in constraint:
        return compiler.compile_regex(constraint["regex"])
    if "choice" in constraint:
        lit = lambda c: '"' + "".join(CHOICE_ESCAPES.get(ch, ch) for ch in c) + '"'     # noqa: E731
        return compiler.compile_grammar("root ::= " + " | ".join(map(lit, constraint["choice"])))
    return compiler.compile_grammar(constraint["grammar"])


def constrained_reference(path, prompt_ids, constraint: dict, max_new_tokens: int) -> tuple[list[int], str]:
    """(generated ids, the EOS included where it stopped; "stop" or "length")."""
    from xgrammar.contrib.hf import LogitsProcessor

    model, _ = load(path)
    prompt = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_ids(path), pad_token_id=eos_ids(path)[0],
                             logits_processor=[LogitsProcessor(compiled(path, constraint))])
    ids = out[0, prompt.shape[1]:].tolist()
    return ids, "stop" if ids and ids[-1] in eos_ids(path) else "length"


def vllm_sequences(tok, words) -> list[list[int]]:
    """The token sequences vLLM bans for ``words`` (``SamplingParams.update_from_tokenizer``,
    written out again): each word without its leading whitespace, and after a space where
    that gives a different first token and as many tokens."""
    seqs = []
    for w in words:
        plain = tok(w.lstrip(), add_special_tokens=False)["input_ids"]
        spaced = tok(" " + w.lstrip(), add_special_tokens=False)["input_ids"]
        seqs.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
    return seqs


def banned_word(tok, output_ids) -> str:
    """A word whose one-token form ``output_ids`` takes (banning it changes the answer there)."""
    return next(tok.decode([t]).strip() for t in output_ids if tok.decode([t]).strip()
                and [t] in vllm_sequences(tok, [tok.decode([t]).strip()]))
