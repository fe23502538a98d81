"""Running a transformers causal LM, or a slice of its layers, on a paged KV cache.

:class:`ModelExecutor` is the fast path for the Llama, Qwen2, Qwen3 and Mistral families.
It calls the model's own modules (embedding, norms, q/k/v/o projections, Qwen3's per-head
query and key norms, MLP, rotary embedding, LM head), so a peft LoRA wrapped around any projection applies unchanged;
only attention is its own: new keys/values go into the paged cache, and a kernel reads
them where they lie through the block tables (:mod:`.attention`: the native C kernel on
the CPU, the Triton kernel on a GPU), or, as a fallback and for autograd,
``scaled_dot_product_attention`` over gathered copies. Grouped query attention folds each
key/value head's query group into the query rows, so no key/value is ever repeated.

An executor runs layers ``[first, last)``: the embedding only on the first slice, the
final norm and the LM head only on the last, and a KV cache for its own layers alone. A
middle slice takes and returns hidden states; chaining slices gives the whole model.

Other causal LMs get :class:`FallbackExecutor`: the model's own forward, one sequence at
a time with its own transformers cache. Correct and slower; it says so once in the log.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from raycolo.errors import ConfigError
from raycolo.engine.executor.attention import AttentionKernel, choose_kernel, fused_pointwise, paged_attention
from raycolo.engine.executor.batch import SeqChunk, StepBatch
from raycolo.engine.executor.fused import FUSE_PROJECTIONS, apply_linear, fuse_layers, project
from raycolo.engine.executor.graphs import DecodeBatch, DecodeGraphs, static_rope
from raycolo.engine.executor.heap import keep_freed_memory
from raycolo.engine.executor.kv_cache import PagedKVCache
from raycolo.engine.executor.native import heads_contiguous
from raycolo.engine.executor.row_lora import RowLoRA
from raycolo.engine.executor.packed import pack_linears
from raycolo.engine.executor.tensor_parallel import TensorParallel, local_heads, shard_layers

log = logging.getLogger("raycolo.engine.executor")

FAST_PATH_FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
FAST_PATH_NAMES = ", ".join(FAST_PATH_FAMILIES.values())


def fast_path_family(model) -> Optional[str]:
    """The fast-path family of a transformers (or peft-wrapped) causal LM, or None."""
    base = _unwrap(model)
    return base.config.model_type if base.config.model_type in FAST_PATH_FAMILIES else None


def _unwrap(model):
    """A peft ``PeftModel`` wraps the transformers model; its layers hold the LoRA."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _lora_layer(model):
    """One of the LoRA layers peft put into the model (they switch together), or None."""
    if not any(type(m).__module__.startswith("peft.") for m in model.modules()):
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    return next((m for m in model.modules() if isinstance(m, BaseTunerLayer)), None)


def _layer_range(num_layers: int, layers: Optional[tuple[int, int]]) -> tuple[int, int]:
    first, last = layers if layers is not None else (0, num_layers)
    if not 0 <= first < last <= num_layers:
        raise ConfigError(f"layers: [{first}, {last}) is not a non-empty slice of the model's "
                          f"{num_layers} layers")
    return first, last


class ModelExecutor:
    """Batched prefill and decode of a fast-path family's model slice on a paged cache."""

    paged = True

    def __init__(self, model, num_blocks: int, block_size: int,
                 layers: Optional[tuple[int, int]] = None, pack_weights: bool = True,
                 native_attention: bool = True, cuda_graphs: bool = False,
                 attention: Optional[AttentionKernel] = None, tp: Optional[TensorParallel] = None,
                 fuse_projections: bool = FUSE_PROJECTIONS, device=None):
        """``device``: where to compute, for a model loaded in host memory: the slice's
        layers (this rank's shard of them, under ``tp``), and the embedding, final norm and
        LM head where the slice uses them, move there once cut, so the device never holds
        what other stages or ranks hold. None: where the model is."""
        base = _unwrap(model)
        family = fast_path_family(base)
        if family is None:
            raise ConfigError(f"model: {type(base).__name__} has no fast path ({FAST_PATH_NAMES}); "
                              "use create_executor for the fallback")
        cfg = base.config
        self.model, self.config = model, cfg
        self.num_layers = cfg.num_hidden_layers
        self.first, self.last = _layer_range(self.num_layers, layers)
        inner = base.model
        self.embed = inner.embed_tokens if self.is_first else None
        self.norm = inner.norm if self.is_last else None
        self.rotary = inner.rotary_emb
        self.layers = list(inner.layers[self.first:self.last])
        # Tensor parallelism (tensor_parallel.py): this rank's slice of every projection,
        # an all-reduce after o_proj and down_proj. Done before the weights are packed.
        self.tp = tp if tp is not None and tp.world > 1 else None
        if self.tp is not None:
            shard_layers(self.layers, cfg, self.tp)
        if device is not None:
            for part in (*self.layers, self.embed, self.norm, self.rotary, base.lm_head if self.is_last else None):
                if part is not None:
                    part.to(device)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads, self.kv_heads = local_heads(attn, self.head_dim)     # this rank's, under tp
        self.group = self.heads // self.kv_heads
        self.scale = attn.scaling
        self.qk_norm = hasattr(attn, "q_norm")      # Qwen3: an RMSNorm of each head's query and key
        self.windows = [self._window(layer.self_attn) for layer in self.layers]
        self.apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        param = next(self.layers[0].parameters())
        self.dtype, self.device = param.dtype, param.device
        if self.device.type == "cpu":
            keep_freed_memory()    # reuse step temporaries instead of faulting in new pages
        self.block_size = block_size
        # Attention reads the cache in place (attention.py): the native kernel on the CPU,
        # Triton on CUDA; ``native_attention=False`` asks for the torch path (gather + SDPA).
        self.kernel = choose_kernel(attention if native_attention else AttentionKernel.TORCH,
                                    self.dtype, self.device)
        self.native = self.kernel.in_place
        # ... and in inference the residual adds, RMSNorms, rotary (with the cache write) and
        # SiLU fuse: the native kernels in float32 on the CPU, Triton's with the Triton kernel.
        self.pointwise = fused_pointwise(self.kernel, self.dtype, self.device)
        self.fused = (self.pointwise is not None and all(_fusable(layer) for layer in self.layers)
                      and (self.norm is None or _is_rms_norm(self.norm)))
        # In inference q/k/v run as one product, and gate/up as one (fused.py), where they
        # are plain linears; on the CPU, frozen projections multiply with oneDNN-packed
        # weights (packed.py). Both after tensor-parallel sharding: this rank's rows. Gate/up
        # fuse only where the fused forward runs the MLP itself (self.fused).
        self.fusion = fuse_layers(self.layers, pack_weights, [self.fused] * len(self.layers)) \
            if fuse_projections else [None] * len(self.layers)
        self.packed = pack_linears(self.layers, base if self.is_last else None,
                                   [f.fused_names() if f else set() for f in self.fusion]) if pack_weights else 0
        self.packed += sum(p.packed for p in self._fused_projections())
        self.lm_head = base.lm_head if self.is_last else None      # (packed, where packing applies)
        # Decode steps as CUDA graphs (graphs.py) on a CUDA device, one set per adapter
        # state of a peft model. The cache then holds one scratch block past num_blocks.
        # The adapter state is read from a layer of this executor's own slice: a pipeline
        # stage drops the other stages' layers, and peft's switches reach only the layers
        # still in the model (a dropped layer 0 would key every state of a later stage alike).
        self.lora = _lora_layer(torch.nn.ModuleList(self.layers))
        graphs = cuda_graphs and self.device.type == "cuda" and (self.tp is None or _nccl(self.tp)) \
            and static_rope(self.rotary)
        self.cache = PagedKVCache(len(self.layers), num_blocks + (1 if graphs else 0), block_size, self.kv_heads,
                                  self.head_dim, self.dtype, self.device)
        self.graphs = DecodeGraphs(self, num_blocks, capture=True) if graphs else None
        # Each row's own LoRA version for one step (row_lora.py; set by an online stage
        # around a step that mixes versions, None otherwise).
        self.row_lora: Optional[RowLoRA] = None

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.tp.enter(x)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.tp.reduce(x)

    def adapter_state(self) -> tuple:
        """What a captured decode step depends on besides its shape: for a peft model,
        whether its adapters are switched off, which are active, which are merged."""
        lora = self.lora
        if lora is None:
            return ()
        return (bool(lora.disable_adapters), tuple(lora.active_adapters), tuple(lora.merged_adapters))

    @property
    def graph_captures(self) -> int:
        """How many decode graphs this executor has captured (0 without graphs)."""
        return 0 if self.graphs is None else self.graphs.captures

    def sleep(self) -> None:
        """Free the KV cache (an engine put to sleep); :meth:`wake_up` makes a fresh one.
        Captured graphs go too: they hold the cache's and the weights' addresses."""
        self.cache.drop()
        if self.graphs is not None:
            self.graphs.clear()
        for f in self._fused_projections():     # their weights may move off the device next
            f.release()

    def wake_up(self) -> None:
        self.cache.allocate()
        for f in self._fused_projections():     # rows of one weight again, before any capture
            f.ensure_fused()

    def _fused_projections(self) -> list:
        return [p for f in self.fusion if f is not None for p in f.projections()]

    def _window(self, attn) -> Optional[int]:
        if hasattr(attn, "sliding_window"):      # Qwen2: per layer type
            return attn.sliding_window
        return getattr(self.config, "sliding_window", None)  # Mistral

    @property
    def is_first(self) -> bool:
        return self.first == 0

    @property
    def is_last(self) -> bool:
        return self.last == self.num_layers

    def batch(self, chunks: Sequence[SeqChunk]) -> "StepBatch | DecodeBatch":
        if self.graphs is not None:
            decode = self.graphs.decode_batch(chunks)
            if decode is not None:
                return decode
        native = self.native
        if native:
            top = max((b for c in chunks for b in c.table), default=0)
            if top >= self.cache.num_blocks or min((b for c in chunks for b in c.table), default=0) < 0:
                raise ValueError(f"a block table names block {top}; the cache has "
                                 f"{self.cache.num_blocks}")
        return StepBatch.build(chunks, self.block_size, self.device, with_ids=self.is_first,
                               groups=not native, tiles=self.kernel is AttentionKernel.TRITON)

    @torch.inference_mode()
    def execute(self, batch: StepBatch, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the slice on one step. The first slice embeds ``batch.input_ids``; later ones
        take ``hidden`` (num_tokens, hidden_size) from the slice before. The last slice
        returns the logits of each sequence's last token (num_seqs, vocab), or of each of
        its tokens where its chunk asks for ``every_logit`` (``SeqChunk.logit_rows`` rows
        per sequence, in order); other slices return hidden states (num_tokens, hidden_size)."""
        if isinstance(batch, DecodeBatch):
            return self.graphs.run(batch, hidden)
        return self.forward(batch, hidden)

    def forward(self, batch: StepBatch, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`execute` without inference mode (the trainer's forward, with autograd)."""
        if self.is_first:
            x = self.embed(batch.input_ids)
        else:
            if hidden is None or hidden.shape[0] != batch.num_tokens:
                raise ValueError(f"layers [{self.first}, {self.last}): need hidden states for "
                                 f"{batch.num_tokens} tokens")
            x = hidden
        if self.fused and not torch.is_grad_enabled():
            return self._forward_fused(batch, x.clone() if hidden is not None else x)
        x = x.unsqueeze(0)  # (1, tokens, hidden): the modules' (batch, seq, hidden)
        cos, sin = self.rotary(x, batch.positions.unsqueeze(0))
        rope = (cos[0], sin[0])
        for i, layer in enumerate(self.layers):
            residual = x
            h = layer.input_layernorm(x)
            x = residual + self._attention(i, layer.self_attn, h[0], rope, batch).unsqueeze(0)
            residual = x
            x = residual + self._mlp(layer, layer.post_attention_layernorm(x))
        x = x[0]
        if not self.is_last:
            return x
        last = x.index_select(0, batch.last_index)
        return self.lm_head(self.norm(last))

    def _mlp(self, layer, h: torch.Tensor) -> torch.Tensor:
        """The layer's MLP on (1, tokens, hidden): its module, or with per-row adapters
        (``row_lora``) its gated SiLU product spelled out, so each LoRA layer adds each row's own."""
        if self.row_lora is None:
            return self._reduce(layer.mlp(self._enter(h)))
        mlp = layer.mlp
        gate, up = project(None, (mlp.gate_proj, mlp.up_proj), h[0], self.row_lora)
        return apply_linear(mlp.down_proj, mlp.act_fn(gate) * up, self.row_lora).unsqueeze(0)

    def _forward_fused(self, batch: StepBatch, x: torch.Tensor) -> torch.Tensor:
        """The same layers with fused pointwise steps (``self.pointwise``; no autograd):
        ``x`` is the residual stream, updated in place; each residual add runs in one pass
        with the RMSNorm after it, rotary runs in place with the cache write, SiLU and the
        gate product in one. The projections are still the model's modules (LoRA applies)."""
        ops = self.pointwise
        cos, sin = self.rotary(x, batch.positions.unsqueeze(0))
        rope = (cos[0].contiguous(), sin[0].contiguous())
        h = ops.add_rms_norm(x, None, *_norm_args(self.layers[0].input_layernorm))
        for i, layer in enumerate(self.layers):
            a = self._attention(i, layer.self_attn, h, rope, batch, fused=True)
            h = ops.add_rms_norm(x, a, *_norm_args(layer.post_attention_layernorm))
            mlp, fusion = layer.mlp, self.fusion[i]
            gate, up = project(fusion and fusion.gate_up, (mlp.gate_proj, mlp.up_proj), h, self.row_lora)
            m = self._reduce(apply_linear(mlp.down_proj, ops.silu_mul(gate, up), self.row_lora))
            if i + 1 < len(self.layers):
                h = ops.add_rms_norm(x, m, *_norm_args(self.layers[i + 1].input_layernorm))
            else:
                x += m
        if not self.is_last:
            return x
        last = x.index_select(0, batch.last_index)
        return self.lm_head(ops.add_rms_norm(last, None, *_norm_args(self.norm)))

    def forward_train(self, x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """The slice over whole sequences, with autograd and without the KV cache (a
        training forward). ``x``: token ids (B, T) on the first slice, else hidden states
        (B, T, hidden) from the slice before; sequences are right-padded to T and
        ``lengths`` holds their true lengths. Returns hidden states (B, T, hidden), or on the
        last slice the logits of every position (B, T, vocab). Padded positions hold
        garbage: leave them out of the loss (their labels are -100)."""
        if self.is_first:
            x = self.embed(x)
        elif x.dim() != 3:
            raise ValueError(f"layers [{self.first}, {self.last}): need hidden states (B, T, hidden)")
        b, t = x.shape[:2]
        positions = torch.arange(t, device=x.device).unsqueeze(0).expand(b, t)
        cos, sin = self.rotary(x, positions)
        keys = torch.arange(t, device=x.device)
        causal = keys.view(1, t) <= keys.view(t, 1)                       # (T, T): key <= query
        valid = keys.view(1, t) < torch.tensor(list(lengths), device=x.device).view(b, 1)
        masks = {}
        for i, layer in enumerate(self.layers):
            window = self.windows[i]
            if window not in masks:
                m = causal if window is None else causal & (keys.view(t, 1) - keys.view(1, t) < window)
                masks[window] = (m.unsqueeze(0) & valid.unsqueeze(1)).unsqueeze(1)  # (B, 1, T, T)
            residual = x
            h = layer.input_layernorm(x)
            x = residual + self._train_attention(layer.self_attn, h, (cos, sin), masks[window])
            residual = x
            x = residual + self._reduce(layer.mlp(self._enter(layer.post_attention_layernorm(x))))
        if not self.is_last:
            return x
        return self.lm_head(self.norm(x))

    def _train_attention(self, attn, h: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape[0], h.shape[1], self.head_dim
        h = self._enter(h)
        q, k = attn.q_proj(h).view(b, t, self.heads, d), attn.k_proj(h).view(b, t, self.kv_heads, d)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                        # (B, heads, T, d)
        v = attn.v_proj(h).view(b, t, self.kv_heads, d).transpose(1, 2)
        q, k = self.apply_rope(q, k, *rope)
        # A padded query row sees no key at all; let it see itself so softmax stays finite.
        mask = mask | torch.eye(t, dtype=torch.bool, device=h.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                           enable_gqa=self.group > 1)
        return self._reduce(attn.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * d)))

    def _attention(self, i: int, attn, h: torch.Tensor, rope, batch: StepBatch,
                   fused: bool = False) -> torch.Tensor:
        n, d = h.shape[0], self.head_dim
        fusion = self.fusion[i]
        q, k, v = project(fusion and fusion.qkv, (attn.q_proj, attn.k_proj, attn.v_proj), self._enter(h),
                          self.row_lora)
        q, k, v = q.view(n, self.heads, d), k.view(n, self.kv_heads, d), v.view(n, self.kv_heads, d)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        if fused and heads_contiguous(q) and heads_contiguous(k):
            self.pointwise.rope_and_write(self.cache, i, batch.slots, q, k, v, *rope)
        else:
            q, k = self.apply_rope(q, k, *rope, unsqueeze_dim=1)
            self.cache.write(i, batch.slots, k, v)
        if batch.tables is not None:  # the native kernel reads K/V in place
            if q.requires_grad:
                raise ValueError(f"the {self.kernel.value} attention kernel has no backward: run "
                                 "the executor under torch.inference_mode (execute)")
            o = paged_attention(self.kernel, q, self.cache.keys[i], self.cache.values[i], batch,
                                self.windows[i], self.scale)
            return self._reduce(apply_linear(attn.o_proj, o.view(n, self.heads * d), self.row_lora))
        groups = batch.groups
        if len(groups) == 1 and groups[0].out_index is None:  # decode, rows in batch order
            return self._reduce(apply_linear(attn.o_proj, self._group_attention(i, q, groups[0]), self.row_lora))
        out = q.new_empty((n, self.heads * d))
        for g in groups:
            out.index_copy_(0, g.out_index, self._group_attention(i, q, g).index_select(0, g.out_src))
        return self._reduce(apply_linear(attn.o_proj, out, self.row_lora))

    def _group_attention(self, i: int, q: torch.Tensor, g) -> torch.Tensor:
        """Attention of one group: (rows * Lq, heads * head_dim) in padded query order."""
        rows, lq, kvh, grp, d = g.rows, g.query_len, self.kv_heads, self.group, self.head_dim
        keys, values = self.cache.read(i, g.tables)            # (rows, kvh, T, d)
        qg = q.index_select(0, g.query_index) if g.out_index is not None else q
        # (rows, Lq, kvh, grp, d) -> (rows, kvh, grp * Lq, d): a query group shares its K/V head
        qg = qg.view(rows, lq, kvh, grp, d).permute(0, 2, 3, 1, 4).reshape(rows, kvh, grp * lq, d)
        mask = g.mask(self.windows[i], keys.shape[2])          # (rows, 1, Lq, T)
        if grp > 1:
            mask = mask.unsqueeze(2).expand(rows, 1, grp, lq, mask.shape[-1]).reshape(
                rows, 1, grp * lq, mask.shape[-1])
        o = _attend(qg, keys, values, mask, self.scale)
        return o.view(rows, kvh, grp, lq, d).permute(0, 3, 1, 2, 4).reshape(rows * lq, kvh * grp * d)


def _nccl(tp: TensorParallel) -> bool:
    """NCCL's collectives can be captured in a CUDA graph; gloo's (host copies) cannot."""
    import torch.distributed as dist

    return dist.get_backend(tp.group) == "nccl"


def _is_rms_norm(norm) -> bool:
    """transformers' RMSNorm of a fast-path family: ``weight * x * rsqrt(mean(x**2) + eps)``."""
    return type(norm).__name__ in tuple(f"{name}RMSNorm" for name in FAST_PATH_FAMILIES.values())


def _norm_args(norm) -> tuple[torch.Tensor, float]:
    return norm.weight, norm.variance_epsilon


def _fusable(layer) -> bool:
    """Whether a decoder layer's norms and MLP are the ones the fused forward computes."""
    mlp = layer.mlp
    return (_is_rms_norm(layer.input_layernorm) and _is_rms_norm(layer.post_attention_layernorm)
            and type(mlp).__name__ in tuple(f"{name}MLP" for name in FAST_PATH_FAMILIES.values())
            and getattr(mlp.config, "hidden_act", None) == "silu")


def _attend(q, k, v, mask, scale):
    """softmax(q k^T * scale, masked) v. On the CPU, plain matmuls on contiguous K/V beat
    ``scaled_dot_product_attention`` on these small per-row shapes (docs/executor.md)."""
    if q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.contiguous().transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.contiguous())


class FallbackExecutor:
    """Any causal LM through its own forward: one sequence at a time, each with its own
    transformers cache, no paging. Whole models only (no layer slices)."""

    paged = False
    graph_captures = 0      # it captures no CUDA graphs (ModelExecutor.graph_captures)
    _warned: set = set()

    def __init__(self, model, num_blocks: int, block_size: int,
                 layers: Optional[tuple[int, int]] = None):
        base = _unwrap(model)
        n = getattr(base.config, "num_hidden_layers", None)
        if layers is not None and n is not None and tuple(layers) != (0, n):
            raise ConfigError(f"layers: {type(base).__name__} has no fast path, and the fallback "
                              "runs whole models only")
        self.model, self.config = model, base.config
        self.block_size = block_size
        self.is_first = self.is_last = True
        self.caches: dict[int, object] = {}  # sequence handle -> its transformers cache
        name = type(base).__name__
        if name not in FallbackExecutor._warned:
            FallbackExecutor._warned.add(name)
            log.warning("raycolo executor: %s is not in the fast path (%s); running the model's "
                        "own forward one sequence at a time (correct, slower)", name, FAST_PATH_NAMES)

    def sleep(self) -> None:
        """Forget every sequence's cache (an engine put to sleep)."""
        self.caches.clear()

    def wake_up(self) -> None:
        pass

    def batch(self, chunks: Sequence[SeqChunk]) -> list[SeqChunk]:
        return list(chunks)

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk], hidden=None, handles: Sequence[int] = ()) -> torch.Tensor:
        from transformers import DynamicCache

        param = next(self.model.parameters())
        rows = []
        for handle, c in zip(handles, chunks):
            cache = self.caches.get(handle) if c.start else None
            if c.start and cache is None:
                raise ValueError(f"sequence {handle}: no cache to continue from position {c.start}")
            cache = cache if cache is not None else DynamicCache()
            ids = torch.tensor([list(c.tokens)], device=param.device)
            pos = torch.arange(c.start, c.start + len(c.tokens), device=param.device).unsqueeze(0)
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                             attention_mask=torch.ones((1, c.start + len(c.tokens)), dtype=torch.long,
                                                       device=param.device))
            self.caches[handle] = out.past_key_values
            rows.append(out.logits[0, -c.logit_rows:])
        return torch.cat(rows)

    def free(self, handle: int) -> None:
        self.caches.pop(handle, None)


def create_executor(model, num_blocks: int, block_size: int,
                    layers: Optional[tuple[int, int]] = None, cuda_graphs: bool = False,
                    fuse_projections: bool = FUSE_PROJECTIONS):
    """The fast executor where the model's family has one, the fallback otherwise.
    ``cuda_graphs``: replay decode steps as CUDA graphs on a CUDA device (graphs.py);
    ``fuse_projections``: q/k/v and gate/up each as one product in inference (fused.py)."""
    if fast_path_family(model):
        return ModelExecutor(model, num_blocks, block_size, layers, cuda_graphs=cuda_graphs,
                             fuse_projections=fuse_projections)
    return FallbackExecutor(model, num_blocks, block_size, layers)
