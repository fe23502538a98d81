"""What bench/gpu_realsize.py measures with: real-size Llama shapes with seeded random
weights built on the device, their byte and FLOP counts, and the card's own limits
(copy bandwidth, matmul rate) measured in the same run."""
from __future__ import annotations

import statistics
import time

import torch

BLOCK = 16          # KV block size of every run
LORA_RANK = 8

SHAPES = {      # transformers LlamaConfig fields; Llama-3's published shapes, rope scaling aside
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                        max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 tie_word_embeddings=False),
}
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_loop(fns, device, calls: int, repeats: int = 5) -> float:
    """Median seconds per call of ``calls`` back-to-back calls cycling through ``fns`` (one
    synchronisation per loop, not per call: a short kernel's time, not the launch and sync
    around it), over ``repeats`` loops after a warm-up of each. Cycling through buffers
    larger than the L2 cache makes each call read from memory."""
    for fn in fns:
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        sync(device)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def limits(device, dtype) -> dict:
    """The card's copy bandwidth (bytes read + written per second) and matmul rate, each
    from loops of back-to-back calls; the matmuls after about 0.1 s of warm-up, so the
    clocks are those a sustained prefill runs at."""
    cuda = device.type == "cuda"
    n = (1 << 30) if cuda else (1 << 24)          # bytes per buffer
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = timed_loop([lambda: dst.copy_(src)], device, 20 if cuda else 3)
    m = 8192 if cuda else 512
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    for _ in range(64 if cuda else 1):
        a @ b
    mm = timed_loop([lambda: a @ b], device, 64 if cuda else 3)
    return {"copy_bytes_per_s": 2 * n / copy, "matmul_flops": 2 * m ** 3 / mm}


def build_model(shape: str, device, dtype, seed: int = 0):
    """A Llama model of ``shape`` with seeded random weights (normal, std 0.02; norms 1)
    made on ``device`` in ``dtype``, and a byte tokenizer over its vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from raycolo.engine.models import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer

    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval(), ByteTokenizer(cfg.vocab_size)


def prompts_for(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    from raycolo.engine.models import BOS_ID, BYTE_OFFSET

    gen = torch.Generator().manual_seed(seed)
    body = torch.randint(BYTE_OFFSET, vocab, (batch, length - 1), generator=gen)
    return [[BOS_ID] + row for row in body.tolist()]


class Model:
    """One shape's byte counts: what a decode step must read, what a prefill computes."""

    def __init__(self, model):
        cfg = model.config
        self.cfg, self.itemsize = cfg, next(model.parameters()).element_size()
        embed = model.get_input_embeddings().weight
        tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
        self.params = sum(p.numel() for p in model.parameters())
        self.layer_params = sum(p.numel() for p in model.model.layers.parameters())
        self.head_params = embed.numel()                      # the LM head's matrix
        self.read_params = self.params - (0 if tied else embed.numel())   # all but the embedding
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * self.itemsize
        self.attn_flops_per_key = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * hd

    def decode_bytes(self, batch: int, context: float) -> float:
        return (self.read_params + batch * self.cfg.hidden_size) * self.itemsize + batch * context * self.kv_per_token

    def prefill_flops(self, tokens: int, seqs: int, prompt: int) -> float:
        keys = tokens * (prompt + 1) / 2                        # causal: half the square
        return 2 * self.layer_params * tokens + 2 * self.head_params * seqs + self.attn_flops_per_key * keys


def active_lora(seed: int = 0):
    """The LoRA the stage rows serve with: rank ``LORA_RANK`` on q/k/v/o."""
    from raycolo.online.stages.stage_model import LoraSettings

    return LoraSettings(rank=LORA_RANK, alpha=2 * LORA_RANK, seed=seed)


def add_active_lora(model, seed: int):
    """``model`` with :func:`active_lora`, every ``lora_B`` random (seeded), so it acts."""
    from raycolo.online.stages.stage_model import add_lora

    model = add_lora(model, active_lora(seed))
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01, generator=gen)
    return model
