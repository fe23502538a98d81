"""Realistic Hugging Face checkpoint directories, built in code from the installed libraries.

``build_checkpoint(kind, path, seed)`` writes what a user downloads from the Hub, in miniature:
``model.safetensors`` + ``config.json`` + ``generation_config.json`` + ``tokenizer.json`` +
``tokenizer_config.json`` (with ``chat_template``) + ``special_tokens_map.json`` (+ ``vocab.json``/
``merges.txt`` where the real model ships them). Nothing is downloaded: the byte-level BPE is trained
with ``tokenizers`` on a seeded English-like corpus (with accented words, CJK, Cyrillic and emoji, so
multi-byte tokens exist), and the model is a seeded random tiny transformer. Same seed -> same bytes.

Kinds, each shaped like the real family so serving code meets the same traps:

* ``llama3`` - LlamaForCausalLM, ``PreTrainedTokenizerFast``; the Llama 3 specials sit ABOVE the
  ordinary vocab at Llama 3's offsets; the post-processor prepends ``<|begin_of_text|>``; the real Llama 3
  chat template (which renders BOS itself). ``tokenizer.eos_token`` is ``<|end_of_text|>``, so
  ``<|eot_id|>`` is an EOS only through ``generation_config.json`` (``eos_token_id`` is a list).
* ``qwen2`` - Qwen2ForCausalLM, ``Qwen2Tokenizer``, ChatML template, no BOS is ever added, tokenizer eos
  ``<|im_end|>`` (as Qwen2-Instruct), generation eos ``[<|im_end|>, <|endoftext|>]``, config vocab padded.
* ``gpt2`` - GPT2LMHeadModel (tied embeddings), ``<|endoftext|>`` as bos/eos, NO chat template,
  generation ``eos_token_id`` a single int: the no-template fallback path.

Random weights almost never emit an EOS, so the model is tilted (``_tilt``): every special's output row
is zeroed (never argmax) except one EOS's, the one the *tokenizer* does not call eos where there is such
(llama3 ``<|eot_id|>``, qwen2 ``<|endoftext|>``; gpt2's only one), and that EOS is the argmax exactly
right after a "trigger" token (those ending in . ! ? plus a seeded 2-3% of the vocab). Greedy decoding
then ends in a loop with or without a trigger: some prompts stop (often within 5-40 tokens), others run
to any limit. ``greedy_cases`` picks both kinds; ``hf_reference`` is the independent reference:
transformers ``generate()`` only, nothing from raycolo.
"""
from __future__ import annotations

import functools
import json
import pathlib
import random

import torch
from tokenizers.decoders import DecodeStream
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

KINDS = ("llama3", "qwen2", "gpt2")

LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen2-Instruct's ChatML; with tools, Qwen2.5-Instruct's tool section (its instructions
# shortened to fit the tiny models' 512-token context), calls and results (hermes form:
# <tool_call>{"name": ..., "arguments": ...}</tool_call>)
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}{{ 'You are a helpful assistant.' }}{% endif %}"
    "{{ '\n\n# Tools\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n</tools>\nCall as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call>"
    "<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}{{ '\n<tool_call>\n{\"name\": \"' + call['function']['name'] "
    "+ '\", \"arguments\": ' }}{{ call['function']['arguments'] | tojson }}{{ '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}{% if loop.first and messages[0]['role'] != 'system' and not tools %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    # Qwen3's: thinking off writes an empty reasoning into the prompt (chat_template_kwargs)
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}")
_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Llama 3's first 16 specials, at their real offsets from the end of the ordinary vocab (128000 + i).
_LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"] + [
                    f"<|reserved_special_token_{i}|>" for i in range(5, 11)]

# Qwen's added tokens that are not special (the tokenizer keeps them in decoded text): the
# reasoning tags (Qwen3, QwQ, DeepSeek-R1's Qwen2 distills) and the tool-call ones (Qwen2.5,
# Qwen3), after the specials, in the model's padded vocabulary rows
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

SPECS = {
    "llama3": dict(vocab=2000, seed=1, specials=_LLAMA3_SPECIALS, split=_SPLIT, nfc=False,
                   bos="<|begin_of_text|>", eos="<|end_of_text|>", pad=None, gen_eos=["<|end_of_text|>", "<|eot_id|>"],
                   tilt="<|eot_id|>", rate=0.03, template=LLAMA3_CHAT_TEMPLATE, cls="PreTrainedTokenizerFast",
                   pad_to=1),
    "qwen2": dict(vocab=1500, seed=2, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  split=_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"), nfc=True, bos=None, eos="<|im_end|>",
                  pad="<|endoftext|>", gen_eos=["<|im_end|>", "<|endoftext|>"], tilt="<|endoftext|>", rate=0.03,
                  template=CHATML_TEMPLATE, cls="Qwen2Tokenizer", pad_to=64, added=QWEN_ADDED),
    # Qwen3: Qwen2's tokenizer and ChatML; the model adds RMSNorms of each head's query and
    # key, and its head_dim (32) is not hidden_size / heads (16), as in the real ones
    # (Qwen3-0.6B: 1024 / 16 heads, head_dim 128). Built on demand (not in KINDS).
    "qwen3": dict(vocab=1500, seed=4, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  split=_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"), nfc=True, bos=None, eos="<|im_end|>",
                  pad="<|endoftext|>", gen_eos=["<|im_end|>", "<|endoftext|>"], tilt="<|endoftext|>", rate=0.03,
                  template=CHATML_TEMPLATE, cls="Qwen2Tokenizer", pad_to=64, added=QWEN_ADDED),
    "gpt2": dict(vocab=1000, seed=3, specials=["<|endoftext|>"], split=None, nfc=False, bos="<|endoftext|>",
                 eos="<|endoftext|>", pad=None, gen_eos="<|endoftext|>", tilt="<|endoftext|>", rate=0.02, template=None,
                 cls="GPT2Tokenizer", pad_to=1),
}

_COMMON = ("the of and to in is that it was for on are as with his they at be this from have or by one had not but "
           "what all were when we there can an your which their said if do will each about how up out them then she "
           "many some so these would other into has more her two like him see time could no make than first been "
           "its who now people my made over did down only way find use may water long little very after words "
           "called just where most know get through back much before go good new write our used me man too any day "
           "same right look think also around another came come work three word must because does part don't it's "
           "river garden morning light stone window letter music silver winter city road quiet bright").split()
_EXOTIC = ("café naïve über façade jalapeño résumé Zürich señor déjà São Paulo Ελλάδα 日本 東京 学生 Привет мир "
           "😀 🚀 — € ½ °C").split()


def make_corpus(seed: int, n_chars: int = 120_000) -> str:
    """Seeded English-like text: Zipf-weighted common words, invented words, some non-ASCII, numbers."""
    rng = random.Random(seed)
    sy_on, sy_v, sy_co = "b c d f g h k l m n p r s t v w br cl st tr sh th".split(), "a e i o u ai ea ou".split(), \
        ["", "", "n", "r", "s", "t", "ck", "ng", "ll"]
    invented = ["".join(rng.choice(sy_on) + rng.choice(sy_v) + rng.choice(sy_co) for _ in range(rng.randint(1, 3)))
                for _ in range(400)]
    weights = [1 / (r + 1) for r in range(len(_COMMON))]
    out, size = [], 0
    while size < n_chars:
        words = []
        for _ in range(rng.randint(4, 16)):
            u = rng.random()
            w = (rng.choices(_COMMON, weights)[0] if u < 0.7 else rng.choice(invented) if u < 0.88
                 else rng.choice(_EXOTIC) if u < 0.95 else str(rng.randint(0, 2025)))
            words.append(w + ("," if rng.random() < 0.08 else ""))
        sentence = " ".join(words).rstrip(",")
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".....?!:")
        sentence = f'"{sentence}"' if rng.random() < 0.05 else sentence
        out.append(sentence + ("\n\n" if rng.random() < 0.15 else " "))
        size += len(out[-1])
    return "".join(out)


def _train_tokenizer(spec: dict, seed: int) -> tuple[Tokenizer, int]:
    """Byte-level BPE trained on the corpus; specials appended after the ordinary vocab (high ids)."""
    tok = Tokenizer(models.BPE())
    if spec["nfc"]:
        tok.normalizer = normalizers.NFC()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec["split"] is None)
    tok.pre_tokenizer = byte_level if spec["split"] is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec["vocab"], min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([p + "\n\n" for p in make_corpus(seed * 1000 + spec["seed"]).split("\n\n")], trainer)
    n_ordinary = tok.get_vocab_size()
    assert n_ordinary == spec["vocab"], (n_ordinary, spec["vocab"])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["specials"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.get("added", ())])
    bl = processors.ByteLevel(trim_offsets=False, add_prefix_space=False, use_regex=spec["split"] is None)
    if spec["bos"] and spec["cls"] == "PreTrainedTokenizerFast":  # llama3: BOS through the post-processor
        b = spec["bos"]
        tok.post_processor = processors.Sequence([bl, processors.TemplateProcessing(
            single=f"{b}:0 $A:0", pair=f"{b}:0 $A:0 {b}:1 $B:1", special_tokens=[(b, tok.token_to_id(b))])])
    else:
        tok.post_processor = bl
    return tok, n_ordinary


def _write_tokenizer(tok: Tokenizer, spec: dict, path: pathlib.Path) -> None:
    tok.save(str(path / "tokenizer.json"))
    if spec["cls"] != "PreTrainedTokenizerFast":  # qwen2 and gpt2 also ship vocab.json + merges.txt
        tok.model.save(str(path))
    decoder = {str(tok.token_to_id(t)): dict(content=t, lstrip=False, normalized=False, rstrip=False,
                                             single_word=False, special=t in spec["specials"])
               for t in spec["specials"] + spec.get("added", [])}
    special = {k: spec[k] for k in ("bos", "eos", "pad") if spec[k]}
    cfg = dict(added_tokens_decoder=decoder, **{f"{k}_token": v for k, v in special.items()},
               clean_up_tokenization_spaces=False, model_max_length=512, tokenizer_class=spec["cls"],
               model_input_names=["input_ids", "attention_mask"])
    if spec["template"]:
        cfg["chat_template"] = spec["template"]
    if spec["cls"] == "Qwen2Tokenizer":
        cfg.update(bos_token=None, unk_token=None, errors="replace", split_special_tokens=False)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (path / "special_tokens_map.json").write_text(json.dumps(
        {f"{k}_token": v for k, v in special.items()}, indent=2) + "\n")


def _make_model(kind: str, vocab_size: int, ids: dict, hidden_size: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    common = dict(vocab_size=vocab_size, bos_token_id=ids["bos"], eos_token_id=ids["eos"], tie_word_embeddings=False)
    if kind == "gpt2":
        common.update(tie_word_embeddings=True)
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common))
        with torch.no_grad():  # tied + random => logits ~ e_x . e_y: it would repeat its input token forever;
            w = model.transformer.ln_f.weight  # random signs in the final norm cancel that self-affinity
            w.copy_(torch.randint(0, 2, w.shape) * 2.0 - 1)
        return model
    shape = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    if kind == "llama3":
        return LlamaForCausalLM(LlamaConfig(rope_theta=500000.0, rms_norm_eps=1e-5, **shape, **common))
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        model = Qwen3ForCausalLM(Qwen3Config(rope_theta=1000000.0, rms_norm_eps=1e-6, head_dim=2 * hidden_size // 4,
                                             **shape, **common))
        with torch.no_grad():    # the norms' weights start at 1: make them matter
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
        return model
    return Qwen2ForCausalLM(Qwen2Config(rope_theta=1000000.0, rms_norm_eps=1e-6, **shape, **common))


def _tilt(model, tok: Tokenizer, spec: dict, n_ordinary: int, seed: int) -> list[int]:
    """Make the tilted EOS the argmax exactly after "trigger" tokens (those ending in . ! ? plus a seeded
    sample, ``spec["rate"]`` of the vocab) and nowhere else; silence every other special. Returns the triggers.

    Two residual dims (flag, anchor) are reserved: the triggers' embeddings hold (+1, -1) there, all other
    tokens (0, 0), and no layer writes to them. After the final norm they are equal (LayerNorm) or both 0
    (RMSNorm) except at a trigger, so the EOS output row ``4 * (e_flag - e_anchor)`` scores exactly 0 at
    every other position (where some ordinary logit is > 0) and wins at a trigger (tied gpt2: the triggers'
    own output rows are ``1 * (e_flag - e_anchor)`` there, less than 4)."""
    flag, anchor = model.config.hidden_size - 2, model.config.hidden_size - 1
    text = {i: tok.decode([i]) for i in range(n_ordinary)}
    triggers = [i for i, t in text.items() if t.rstrip()[-1:] in (".", "!", "?")]
    rest = [i for i, t in text.items() if t.strip() and i not in triggers]
    extra = max(0, int(spec["rate"] * n_ordinary) - len(triggers))
    triggers = sorted(triggers + random.Random(seed).sample(rest, extra))
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    eos = tok.token_to_id(spec["tilt"])
    with torch.no_grad():
        emb[:, [flag, anchor]] = 0
        emb[triggers, flag], emb[triggers, anchor] = 1.0, -1.0
        for name, p in model.named_parameters():  # what writes into the residual stream
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p[[flag, anchor], :] = 0
            elif name.endswith(("c_proj.weight", "wpe.weight")):  # GPT-2's Conv1D is (in, out)
                p[:, [flag, anchor]] = 0
            elif name.endswith(("o_proj.bias", "down_proj.bias", "c_proj.bias", "ln_f.bias")):
                p[[flag, anchor]] = 0
            elif name.endswith(("model.norm.weight", "ln_f.weight")):
                p[[flag, anchor]] = 1
        head[n_ordinary:] = 0
        head[eos, :] = 0
        head[eos, flag], head[eos, anchor] = 4.0, -4.0
    return triggers


def build_checkpoint(kind: str, path, seed: int = 0, hidden_size: int = 64) -> pathlib.Path:
    """Write a complete ``kind`` checkpoint (see module docstring) into ``path``; return it.
    ``hidden_size``: of the llama3 and qwen2 kinds (4 heads: 128 gives head_dim 32, what
    vLLM's CPU attention needs)."""
    spec = SPECS[kind]
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok, n_ordinary = _train_tokenizer(spec, seed)
    _write_tokenizer(tok, spec, path)
    tid = tok.token_to_id
    ids = {k: tid(spec[k] or spec["specials"][0]) for k in ("bos", "eos")}  # qwen2's model bos: <|endoftext|>
    total = tok.get_vocab_size()
    vocab_size = -(-total // spec["pad_to"]) * spec["pad_to"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _make_model(kind, vocab_size, ids, hidden_size).eval()
    _tilt(model, tok, spec, n_ordinary, seed)
    gen_eos = [tid(t) for t in spec["gen_eos"]] if isinstance(spec["gen_eos"], list) else tid(spec["gen_eos"])
    model.save_pretrained(path)
    gen = dict(bos_token_id=ids["bos"], eos_token_id=gen_eos, do_sample=False)
    if spec["pad"]:
        gen["pad_token_id"] = tid(spec["pad"])
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return path


@functools.lru_cache(maxsize=8)
def _load(path: str, stamp):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def load(path):
    """(model, tokenizer) for a checkpoint directory, cached per directory content."""
    st = (pathlib.Path(path) / "model.safetensors").stat()
    return _load(str(path), (st.st_mtime_ns, st.st_size))


def eos_ids(path) -> list[int]:
    """The EOS ids generation stops on: generation_config.json's ``eos_token_id`` (int or list)."""
    eos = load(path)[0].generation_config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def hf_reference(path, prompt_ids, max_new_tokens: int) -> tuple[list[int], str, str]:
    """transformers' greedy ``generate()`` with the checkpoint's own generation_config.
    Returns (generated ids incl. the EOS when it stopped, text without specials/EOS, "stop"|"length")."""
    model, tokenizer = load(path)
    prompt = torch.tensor([list(prompt_ids)])
    pad = model.generation_config.pad_token_id
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=eos_ids(path)[0] if pad is None else pad)
    ids = out[0, prompt.shape[1]:].tolist()
    stopped = bool(ids) and ids[-1] in eos_ids(path)
    # the text as vLLM's detokenizer makes it: tokenizers' DecodeStream primed with the
    # prompt (a character whose bytes max_new_tokens cut off is held back, never emitted)
    stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True)
    body = ids[:-1] if stopped else ids
    text = "".join(stream.step(tokenizer.backend_tokenizer, t) or "" for t in body)
    return ids, text, "stop" if stopped else "length"


def chat_prompt_ids(path, messages: list[dict]) -> list[int]:
    """Reference chat prompt: ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)``."""
    tokenizer = load(path)[1]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


_PROMPTS = ["The river was quiet in the morning", "Write a letter about the winter city", "café naïve über",
            "One two three", "Where did the people go after the music", "日本 東京 and the silver road",
            "How do you find good water", "Привет мир, the garden", "It's a long way back", "Look at the light",
            "She made 42 words", "The first time we came", "Tell me about São Paulo", "What is the stone for?",
            "Because the window was bright", "Our new work", "Then she said: no.", "Many people know the road",
            "A little music 😀", "Could you write it down", "Three days in Zürich", "The silver stone — again",
            "Use the same word", "It was very long"]


def greedy_cases(path, max_new_tokens: int, n: int = 6) -> list[dict]:
    """``n`` (>= 2) deterministic cases (plain prompts; every other one a chat message list where the checkpoint
    has a template) with at least one "stop" (preferably after >= 4 tokens) and one "length" under greedy
    decoding. Each dict: ``prompt`` (str or list of messages), ``prompt_ids``, ``output_ids`` (generated part,
    with the EOS when it stopped), ``text`` (skip_special_tokens, EOS excluded), ``finish_reason``."""
    tokenizer, pool = load(path)[1], []
    good_stop = lambda c: c["finish_reason"] == "stop" and len(c["output_ids"]) >= min(4, max_new_tokens)
    extra = [s.strip() + "." for s in make_corpus(7, 6000).split(".") if 4 < len(s.strip()) < 80]
    for i, p in enumerate(_PROMPTS + extra):  # the corpus sentences: only if the fixed prompts fall short
        if tokenizer.chat_template and i % 2:
            prompt = [{"role": "user", "content": p}]
            prompt_ids = chat_prompt_ids(path, prompt)
        else:
            prompt, prompt_ids = p, tokenizer(p)["input_ids"]
        ids, text, reason = hf_reference(path, prompt_ids, max_new_tokens)
        pool.append(dict(prompt=prompt, prompt_ids=prompt_ids, output_ids=ids, text=text, finish_reason=reason))
        if len(pool) >= n and any(map(good_stop, pool)) and any(c["finish_reason"] == "length" for c in pool):
            break
    stop = next(filter(good_stop, pool), None) or next((c for c in pool if c["finish_reason"] == "stop"), None)
    length = next((c for c in pool if c["finish_reason"] == "length"), None)
    if stop is None or length is None:
        raise AssertionError(f"{path}: no {'stop' if stop is None else 'length'} case at {max_new_tokens} tokens")
    chosen = [stop, length] + [c for c in pool if c is not stop and c is not length][:max(0, n - 2)]
    order = {id(c): i for i, c in enumerate(pool)}
    return sorted(chosen, key=lambda c: order[id(c)])
