"""Loading transformers causal LMs: local checkpoints, or tiny seeded-random ones.

Nothing is downloaded. A ``model_id`` that names a directory loads it with
``from_pretrained`` (with its own tokenizer if it has one); a ``model_id`` that names a
tiny catalog model builds its architecture from config with seeded random weights and a
built-in byte tokenizer.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, get_args

from raycolo.catalog import ModelSpec, get_model
from raycolo.errors import ConfigError

ModelDtype = Literal["float32", "float64", "bfloat16", "float16"]   # the dtypes a model loads in, by torch's names
DTYPES = get_args(ModelDtype)


def torch_dtype(name: str):
    """torch's dtype named ``name`` (one of :data:`DTYPES`). torch is imported here, not with
    this module: a tokenizer alone (an HTTP replica, the offline driver) needs none of it."""
    import torch

    if name not in DTYPES:
        raise KeyError(name)
    return getattr(torch, name)


PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids; ids beyond the bytes decode to nothing
    (the specials and unused ids never show, whatever ``skip_special_tokens`` says)."""

    pad_token_id, bos_token_id, eos_token_id = PAD_ID, BOS_ID, EOS_ID
    eos_token_ids = frozenset({EOS_ID})

    def __init__(self, vocab_size: int):
        if vocab_size < BYTE_OFFSET + 256:
            raise ConfigError(f"vocab: a byte tokenizer needs at least {BYTE_OFFSET + 256} ids")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [BOS_ID] * add_special_tokens + [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes as text (a byte id its byte; the specials and unused ids none):
        what a grammar matches tokens against (raycolo.generation.grammar_masks)."""
        return [bytes([i - BYTE_OFFSET]) if BYTE_OFFSET <= i < BYTE_OFFSET + 256 else b""
                for i in range(self.vocab_size)]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Each id's token as a string: a byte as ``<0xNN>`` (sentencepiece's spelling),
        the specials by name, an unused id as ``<unused_N>``."""
        names = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}
        return [names.get(i) or (f"<0x{i - BYTE_OFFSET:02X}>" if BYTE_OFFSET <= i < BYTE_OFFSET + 256
                                 else f"<unused_{i}>") for i in ids]


class HFTokenizer:
    """A checkpoint's transformers tokenizer, with the checkpoint's EOS set
    (:func:`raycolo.generation.eos_token_ids`: the tokenizer's EOS and every id in
    ``generation_config.json``)."""

    def __init__(self, tok, model_dir: Optional[str | Path] = None):
        from raycolo.generation import eos_token_ids

        self.tok = tok
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.eos_token_ids = eos_token_ids(tok.eos_token_id, model_dir)
        self.vocab_size = len(tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return list(self.tok.convert_ids_to_tokens(ids))


def checkpoint_tokenizer(path: Path, vocab_size: int):
    """The tokenizer of checkpoint directory ``path``: its own where it has one (with the
    EOS set of its generation config), else the byte tokenizer (EOS set: the byte
    tokenizer's EOS and the generation config's)."""
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer
        return HFTokenizer(AutoTokenizer.from_pretrained(path), path)
    from raycolo.generation import eos_token_ids

    tok = ByteTokenizer(vocab_size)
    tok.eos_token_ids = eos_token_ids(EOS_ID, path)
    return tok


TINY_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# The tiny Mistral's and Qwen2's window is shorter than its context, so tests exercise windowed attention.
TINY_SLIDING_WINDOW = 48


def hf_config_for(spec: ModelSpec):
    """A transformers config for a tiny catalog model."""
    import transformers

    if spec.hf_architecture is None:
        raise ConfigError(f"model_id: '{spec.name}' has no hf_architecture; only tiny catalog "
                          "models can be built without a checkpoint directory")
    if spec.hf_architecture not in TINY_ARCHITECTURES:
        raise ConfigError(f"model_id: architecture {spec.hf_architecture} is not supported for tiny models")
    cls = getattr(transformers, spec.hf_architecture.replace("ForCausalLM", "Config"))
    extra = {}
    if spec.hf_architecture == "MistralForCausalLM":
        extra["sliding_window"] = TINY_SLIDING_WINDOW
    if spec.hf_architecture == "Qwen2ForCausalLM":  # full attention in layer 0, windowed after
        extra.update(use_sliding_window=True, sliding_window=TINY_SLIDING_WINDOW, max_window_layers=1)
    return cls(**extra,vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
               num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
               num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.context_length,
               pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
               tie_word_embeddings=spec.tied_embeddings)


# Random weights are for small test models; anything larger must come from a checkpoint.
MAX_RANDOM_PARAMS = 500_000_000


def build_tiny_model(model_id: str, seed: int = 0, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    spec = get_model(model_id)
    if spec.num_params > MAX_RANDOM_PARAMS:
        raise ConfigError(f"model_id: '{model_id}' has {spec.num_params / 1e9:.1f}B parameters; random "
                          "weights are only built for tiny models, give a checkpoint directory instead")
    config = hf_config_for(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(torch_dtype(dtype)).eval(), ByteTokenizer(spec.vocab)


def save_tiny_checkpoint(model_id: str, path: str | Path, seed: int = 0) -> Path:
    """Write a tiny model as a real checkpoint directory (safetensors + config)."""
    model, _ = build_tiny_model(model_id, seed)
    path = Path(path)
    model.save_pretrained(path)
    return path


def load_model(model_id: str, seed: int = 0, dtype: str = "float32", device: str = "cpu"):
    """Returns (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    if device != "cpu" and not torch.cuda.is_available():
        raise ConfigError(f"device: '{device}' requested but CUDA is not available")
    path = Path(model_id)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"model_id: {path} has no config.json")
        # on a GPU the weights go from the files to the device, not through host memory first
        # (an 8B bf16 checkpoint: 16 GB that a host copy would hold, then copy again)
        placed = {} if device == "cpu" else {"device_map": device}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), **placed).eval()
        tokenizer = checkpoint_tokenizer(path, model.config.vocab_size)
    else:
        model, tokenizer = build_tiny_model(model_id, seed, dtype)
    return model.to(device), tokenizer


def checkpoint_context(model_id: Optional[str]) -> Optional[int]:
    """The longest sequence a checkpoint directory's model takes (``max_position_embeddings``,
    GPT-2's ``n_positions``), or None (no directory, or its config does not say)."""
    if not model_id or not Path(model_id).is_dir():
        return None
    import json

    try:
        cfg = json.loads((Path(model_id) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(cfg.get(key), int) and not isinstance(cfg.get(key), bool) and cfg[key] > 0:
            return cfg[key]
    return None


def load_tokenizer(model_id: str):
    """The tokenizer :func:`load_model` would pair with ``model_id``, without the weights
    (the runtime renders and measures prompts in the driver)."""
    path = Path(model_id)
    if path.is_dir():
        config = path / "config.json"
        if not config.exists():
            raise ConfigError(f"model_id: {path} has no config.json")
        import json
        return checkpoint_tokenizer(path, int(json.loads(config.read_text()).get("vocab_size", 0)))
    spec = get_model(model_id)
    if spec.hf_architecture is None or spec.num_params > MAX_RANDOM_PARAMS:
        raise ConfigError(f"model_id: '{model_id}' is not a tiny catalog model; give the node a "
                          "'checkpoint' directory to run it")
    return ByteTokenizer(spec.vocab)
