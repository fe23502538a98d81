"""One pipeline stage that serves and trains: a layer slice of a causal LM with LoRA.

:class:`StageModel` holds layers ``[first, last)`` of a transformers causal LM (the
embedding on the first stage, the final norm and LM head on the last) with peft LoRA
adapters on them, and runs the four ops of a co-located stage:

* ``prefill`` / ``decode``: a batch of requests through the :class:`ModelExecutor` on the
  stage's own paged KV cache (one block table per request, from its own
  :class:`BlockAllocator`); the first stage takes token ids, later stages the hidden
  states of the stage before; the last returns each request's next-token logits;
* ``train_forward``: a micro-batch of whole sequences with autograd, no KV cache; the
  stage keeps its input and output until the backward; the last stage computes the
  causal-LM loss over the completion tokens;
* ``train_backward``: gradients flow from the loss (last stage) or from the gradient of
  the stage's output (sent back by the next stage); the stage's LoRA parameters take one
  optimizer step, and the gradient of its input goes back to the stage before.

LoRA weights change in place, so the next forward of any request sees the update.
Chained stages compute what the unsplit model computes (tests check logits, greedy
tokens and the LoRA weights after a pipelined step). Pure torch and peft: no Ray.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections import OrderedDict
from typing import Collection, Mapping, Optional, Sequence

import torch

from raycolo.engine.executor.batch import SeqChunk
from raycolo.online.stages.losses import IGNORE_INDEX
from raycolo.online.stages.lora_settings import (ADAPTER_WEIGHTS_FILE, BATCHED_VERSIONS,  # noqa: F401  (re-exported)
                                                 LoraSettings)
from raycolo.engine.executor.model import ModelExecutor
from raycolo.online.samples import training_rows  # noqa: F401  (the stage's row layout)
from raycolo.online.stages.row_versions import BASE, row_lora
from raycolo.batching.blocks import BlockAllocator

_DPO_STEP = -1               # the training-task key of a dpo_step (live tasks have ids >= 0)
LATEST = "latest"            # a request's adapter variant: the weights as they train


def add_lora(model, lora: LoraSettings):
    """``model`` wrapped by peft with fresh LoRA adapters (seeded: every stage that wraps
    the same model gets the same initial adapters)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(lora.seed)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def training_batch(samples: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: Optional[int] = None):
    """(prompt ids, completion ids) pairs -> right-padded input ids (B, T), labels (B, T)
    with the prompt and padding at ``IGNORE_INDEX``, and the true lengths."""
    rows = []
    for prompt, completion in samples:
        ids = list(prompt) + list(completion)
        labels = [IGNORE_INDEX] * len(prompt) + list(completion)
        if max_len is not None:
            ids, labels = ids[:max_len], labels[:max_len]
        rows.append((ids, labels))
    t = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros((len(rows), t), dtype=torch.long)
    label_ids = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, labels) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        label_ids[i, :len(labels)] = torch.tensor(labels)
    return input_ids, label_ids, [len(ids) for ids, _ in rows]


def _dpo_of_rows(policy_logits: torch.Tensor, reference_logits: torch.Tensor, labels: torch.Tensor,
                 beta: float) -> torch.Tensor:
    """DPO loss of a preference micro-batch's rows (chosen rows, then rejected rows)."""
    from raycolo.online.stages.losses import dpo_loss, sequence_logprob

    n = labels.shape[0] // 2
    policy, reference = sequence_logprob(policy_logits, labels), sequence_logprob(reference_logits, labels)
    return dpo_loss(policy[:n], policy[n:], reference[:n], reference[n:], beta)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the labelled positions (transformers' loss)."""
    shifted = labels[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             shifted, ignore_index=IGNORE_INDEX)


class StageModel:
    def __init__(self, model, layers: tuple[int, int], num_blocks: int, block_size: int,
                 lr: float = 1e-3, pinned_cache: int = 4, cuda_graphs: bool = False, tp=None,
                 batched_versions: bool = BATCHED_VERSIONS, device=None):
        """``model``: the whole causal LM, already wrapped by :func:`add_lora` where the
        stage trains. Layers outside the slice are dropped from the module tree.
        ``pinned_cache``: saved adapter versions kept loaded (:meth:`forward`'s ``pinned``).
        ``cuda_graphs``: on a CUDA device, decode steps replay as CUDA graphs with the LoRA
        active (one set of graphs per adapter state; graphs.py). ``tp``: this process's
        :class:`~raycolo.engine.executor.tensor_parallel.TensorParallel` rank; the stage then
        holds its slice of the layers' projections and LoRA (tensor_parallel.py), and every
        rank must run the same ops. ``batched_versions``: a step whose requests run on
        different adapter versions runs as one pass where it can (row_versions.py).
        ``device``: where the stage computes, for a model loaded in host memory (only the
        stage's part moves there: ModelExecutor's ``device``)."""
        self.model = model
        self.executor = ModelExecutor(model, num_blocks, block_size, layers, cuda_graphs=cuda_graphs, tp=tp,
                                      device=device)
        self.first, self.last = self.executor.first, self.executor.last
        decoder = _decoder_layers(model)
        for i in range(len(decoder)):
            if not self.first <= i < self.last:
                decoder[i] = torch.nn.Identity()   # another stage's layer: free its weights
        if not hasattr(model, "peft_config"):   # no adapters: serving only, nothing trains
            model.requires_grad_(False)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=lr) if self.trainable else None
        self._train_module = _TrainForward(model, self.executor)
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.contexts: dict[int, int] = {}           # request id -> tokens in this stage's cache
        self._pinned: OrderedDict[str, dict] = OrderedDict()   # adapter directory -> its weights
        self.pinned_cache = max(1, pinned_cache)
        self._train: dict[int, tuple] = {}           # task id -> (input, output or loss)
        self._groups: dict[int, list] = {}           # task id -> its micro-batches' gradients so far
        self.steps = 0
        # A step mixing adapter versions: one pass with each row's own LoRA where the executor
        # runs it eagerly, else one pass per version (row_versions.py).
        self.batched_versions = batched_versions

    @property
    def is_first(self) -> bool:
        return self.executor.is_first

    @property
    def is_last(self) -> bool:
        return self.executor.is_last

    # -- inference -------------------------------------------------------------------------
    def forward(self, requests: Sequence[int], tokens: Sequence[Sequence[int]],
                hidden: Optional[torch.Tensor] = None, base: Sequence[int] = (),
                pinned: Optional[Mapping[int, str]] = None, every_logit: Collection[int] = ()) -> torch.Tensor:
        """Append ``tokens[i]`` to request ``requests[i]`` (a prefill: its prompt; a decode
        step: one token) and run the slice. Token ids matter on the first stage only;
        later stages need their counts and ``hidden`` from the stage before.

        Requests run with the latest adapter, except those in ``base``, which run with the
        adapter switched off (peft's ``disable_adapter``), and those in ``pinned``, which
        run with the adapter version saved in the directory it maps them to (peft's format,
        :func:`raycolo.online.stages.peft_format.export_adapter`). Each such variant is one more
        pass over its own rows. The last stage returns one row of logits per request, or one
        per new token for the requests in ``every_logit`` (prompt log-probabilities)."""
        chunks = self._chunks(requests, tokens, every_logit)
        base, pinned = set(base), dict(pinned or {})
        variants = [BASE if r in base else pinned.get(r, LATEST) for r in requests]
        kinds = list(dict.fromkeys(variants))
        if kinds == [LATEST] or not hasattr(self.model, "disable_adapter"):
            return self.executor.execute(self.executor.batch(chunks), hidden)
        counts = [c.length for c in chunks]
        if self.batched_versions:      # one pass, each row its own version (row_versions.py)
            rows = row_lora(self.model, self.executor, counts, variants, LATEST, self._adapter_name(),
                            self._pinned_state)
            if rows is not None:
                self.executor.row_lora = rows
                try:
                    return self.executor.execute(self.executor.batch(chunks), hidden)
                finally:
                    self.executor.row_lora = None
        starts = [0, *itertools.accumulate(counts)]
        pieces: list = [None] * len(chunks)
        for variant in kinds:
            rows = [i for i, v in enumerate(variants) if v == variant]
            part = None if hidden is None else torch.cat([hidden[starts[i]:starts[i] + counts[i]] for i in rows])
            with self._variant(variant):
                out = self.executor.execute(self.executor.batch([chunks[i] for i in rows]), part)
            split = [chunks[i].logit_rows if self.is_last else counts[i] for i in rows]
            for i, piece in zip(rows, torch.split(out, split)):
                pieces[i] = piece
        return torch.cat(pieces)

    @contextlib.contextmanager
    def _variant(self, variant: str):
        """The adapter weights a variant runs with: the latest (as they are), none (peft's
        ``disable_adapter``), or a saved version swapped in place for the pass and the
        latest weights copied back after it, exactly (training forwards in flight hold
        their own stashed weights, so they never see the swap)."""
        if variant == LATEST:
            yield
            return
        if variant == BASE:
            with self.model.disable_adapter():
                yield
            return
        params = self._lora_params
        saved = self._pinned_state(variant)
        latest = {name: params[name].detach().clone() for name in saved}
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in latest.items():
                    params[name].copy_(value)

    def _pinned_state(self, directory: str) -> dict[str, torch.Tensor]:
        """A saved adapter version's weights for this stage's layers, keyed like
        :meth:`_lora_params`; the last ``pinned_cache`` versions stay loaded."""
        state = self._pinned.pop(directory, None)
        if state is None:
            from safetensors.torch import load_file

            params = self._lora_params
            state = {}
            for key, value in load_file(os.path.join(directory, ADAPTER_WEIGHTS_FILE)).items():
                name = _param_name(key, self._adapter_name())
                if name in params:            # another stage's layer: not ours
                    # safetensors loads to the host: the rows' terms sit beside the live
                    # adapter's weights on the stage's device
                    state[name] = value.to(device=params[name].device, dtype=params[name].dtype)
            if not state:
                raise ValueError(f"adapter {directory}: no weights for layers [{self.first}, {self.last})")
            while len(self._pinned) >= self.pinned_cache:
                self._pinned.pop(next(iter(self._pinned)))
        self._pinned[directory] = state
        return state

    @functools.cached_property
    def _lora_params(self) -> dict[str, torch.nn.Parameter]:
        """The adapter's parameters by name (peft creates them once, with the model)."""
        return {n: p for n, p in self.model.named_parameters() if "lora_" in n}

    def _adapter_name(self) -> str:
        active = self.model.active_adapter
        return active if isinstance(active, str) else active[0]

    def _chunks(self, requests: Sequence[int], tokens: Sequence[Sequence[int]],
                every_logit: Collection[int] = ()) -> list[SeqChunk]:
        chunks, every_logit = [], set(every_logit)
        for rid, toks in zip(requests, tokens):
            start = self.contexts.get(rid, 0)
            need = math.ceil((start + len(toks)) / self.block_size) - self.allocator.blocks_of(rid)
            if need > 0:
                self.allocator.allocate(rid, need)
            chunks.append(SeqChunk(list(toks), start=start, table=self.allocator.tables[rid],
                                   every_logit=self.is_last and rid in every_logit))
            self.contexts[rid] = start + len(toks)
        return chunks

    def release(self, request: int) -> None:
        """The request ended (or was preempted): free its blocks."""
        if request in self.contexts:
            del self.contexts[request]
            self.allocator.release(request)

    # -- training --------------------------------------------------------------------------
    def train_forward(self, task: int, x: torch.Tensor, lengths: Sequence[int],
                      labels: Optional[torch.Tensor] = None, loss_scale: float = 1.0,
                      preference: bool = False, beta: float = 0.1) -> Optional[torch.Tensor]:
        """Forward of a micro-batch: ``x`` is token ids (first stage) or the hidden states
        of the stage before. Returns the hidden states for the next stage (detached), or on
        the last stage the loss (a float; ``labels`` required there). ``loss_scale``
        weights the loss that is backpropagated: a micro-batch's share of the effective
        batch's labelled tokens, when micro-batches accumulate into one step.

        ``preference``: the rows are preference pairs (:func:`training_rows`: the chosen
        rows, then the rejected ones) trained with the DPO loss (``beta``) against the
        frozen base. Each stage then also runs the base (adapter off, no autograd) on the
        same rows and passes both on: its hidden states are the policy's rows followed by
        the reference's (twice the rows of ``lengths``). The last stage's loss is DPO's;
        the gradient that flows back is zero on the reference rows."""
        x = x.to(self.executor.device)          # token ids built on the host (training_batch)
        labels = None if labels is None else labels.to(self.executor.device)
        with torch.enable_grad():
            inp = x if self.is_first else x.detach().requires_grad_(True)
            rows = len(lengths)
            policy_in = inp if self.is_first or not preference else inp[:rows]
            # Weight stashing (PipeDream): the forward runs on clones of the trainable
            # weights, so the optimizer steps of other tasks' backwards, which update the
            # weights in place while this task is between its forward and backward, cannot
            # corrupt its graph; its gradient flows through the clones to the weights.
            stash = {f"model.{n}": p.clone() for n, p in self.model.named_parameters() if p.requires_grad}
            out = torch.func.functional_call(self._train_module, stash, (policy_in, lengths))
            reference = None
            if preference:
                with self.model.disable_adapter(), torch.no_grad():
                    reference = self.executor.forward_train(inp if self.is_first else inp[rows:].detach(), lengths)
            if self.is_last:
                if labels is None:
                    raise ValueError("last stage: train_forward needs labels")
                loss = causal_lm_loss(out, labels) if not preference else \
                    _dpo_of_rows(out, reference, labels, beta)
                self._train[task] = (inp, loss * loss_scale)
                return loss.detach()
            if preference:
                out = torch.cat([out, reference])
        self._train[task] = (inp, out)
        return out.detach()

    def train_backward(self, task: int, grad_output: Optional[torch.Tensor] = None,
                       step: bool = True, group: Optional[int] = None) -> Optional[torch.Tensor]:
        """Backward of the task's forward and one optimizer step on this stage's LoRA
        weights. Returns the gradient of the stage's input (None on the first stage).
        ``step=False`` only accumulates the gradients (a micro-batch of a larger effective
        batch); :meth:`optimizer_step` applies them. With ``group`` (the micro-batches of
        one training task) the gradients accumulate apart from everything else, so other
        tasks' steps in between neither apply nor clear them; the group's ``step`` applies
        its sum."""
        inp, out = self._train.pop(task)
        if self.is_last:
            out.backward()
        else:
            if grad_output is None:
                raise ValueError("train_backward needs the gradient of this stage's output")
            out.backward(grad_output)
        grad_in = None if self.is_first else inp.grad.detach()
        if group is not None:
            kept = self._groups.setdefault(group, [None] * len(self.trainable))
            for i, p in enumerate(self.trainable):
                if p.grad is not None:
                    kept[i] = p.grad if kept[i] is None else kept[i] + p.grad
                    p.grad = None
            if step:
                for p, g in zip(self.trainable, self._groups.pop(group)):
                    p.grad = g
        if step:
            self.optimizer_step()
        return grad_in

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients (one AdamW step) and clear them."""
        if self.optimizer is not None:
            if self.executor.tp is not None:     # replicated LoRA factors: partial gradients
                self.executor.tp.sync_grads()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def drop_training(self, task: int) -> None:
        """Forget a task's forward without stepping (its backward will not come): an
        aborted micro-batch. The adapter, the optimizer state and the gradients accumulated
        by earlier micro-batches stay exactly as they were; its activations are freed."""
        self._train.pop(task, None)

    def start_over(self, state: Mapping[str, torch.Tensor]) -> None:
        """Forget all work under way and go back to the adapter ``state`` (its weights in
        :meth:`lora_state`'s format): every request's cache blocks, stashed training
        activations, accumulated gradients and the optimizer's moments, as a new process
        restoring ``state`` would have them."""
        for request in list(self.contexts):
            self.release(request)
        self._train.clear()
        self._groups.clear()
        for p in self.trainable:
            p.grad = None
        if self.optimizer is not None:
            self.optimizer.state.clear()
        self.load_lora_state(dict(state))

    # -- preference pairs (DPO) ------------------------------------------------------------
    def preference_logprobs(self, pairs: Sequence[tuple], reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence log-probabilities of the chosen and the rejected completion of each
        ``(prompt, chosen, rejected)`` pair (token ids), by the policy (the model with its
        adapter, with autograd) or, with ``reference``, by the frozen base (the adapter
        switched off, no autograd). A whole-model stage (across pipeline stages, the
        ``eval`` op of a preference batch computes them on the last stage)."""
        from raycolo.online.stages.losses import sequence_logprob

        if not (self.is_first and self.is_last):
            raise ValueError("preference_logprobs: a whole-model stage only")
        rows, _ = training_rows(pairs)
        ids, labels, lengths = training_batch(rows)
        ids, labels = ids.to(self.executor.device), labels.to(self.executor.device)
        context = (self.model.disable_adapter() if reference else contextlib.nullcontext())
        with context, (torch.no_grad() if reference else torch.enable_grad()):
            logp = sequence_logprob(self.executor.forward_train(ids, lengths), labels)
        return logp[:len(pairs)], logp[len(pairs):]

    def dpo_step(self, pairs: Sequence[tuple], beta: float = 0.1, step: bool = True) -> float:
        """One DPO update of the adapter on preference pairs (MACE's retraining loss) on a
        whole-model stage: :meth:`train_forward` with ``preference``, its backward, and
        (with ``step``) an optimizer step. Returns the loss before the update."""
        rows, _ = training_rows(pairs)
        ids, labels, lengths = training_batch(rows)
        loss = self.train_forward(_DPO_STEP, ids, lengths, labels, preference=True, beta=beta)
        self.train_backward(_DPO_STEP, step=step)
        return float(loss)

    # -- adapters --------------------------------------------------------------------------
    def lora_state(self, host: bool = False) -> dict[str, torch.Tensor]:
        """This stage's adapter weights in peft's saved format (keys without the adapter
        name): copies on the stage's device, or with ``host`` in host memory (what leaves
        the process: a GPU stage's tensors pickled for an actor without that GPU, or
        without CUDA, would not load there)."""
        from peft import get_peft_model_state_dict

        return {k: v.detach().to("cpu", copy=True) if host else v.detach().clone()
                for k, v in get_peft_model_state_dict(self.model).items()}

    def load_lora_state(self, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        mine = self.lora_state()
        set_peft_model_state_dict(self.model, {k: v for k, v in state.items() if k in mine})


def _param_name(key: str, adapter: str) -> str:
    """A saved LoRA weight's key (peft's file format, no adapter name) as the parameter's
    name in the model: ``...lora_A.weight`` -> ``...lora_A.<adapter>.weight``."""
    for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
        marker = f".{part}."
        if marker in key:
            head, tail = key.rsplit(marker, 1)
            return f"{head}.{part}.{adapter}.{tail}"
    return key


class _TrainForward(torch.nn.Module):
    """The executor's training forward as a module over the model's parameters, so that
    ``torch.func.functional_call`` can run it on stashed weights."""

    def __init__(self, model, executor):
        super().__init__()
        self.model = model
        self.executor = executor

    def forward(self, x, lengths):
        return self.executor.forward_train(x, lengths)


def _decoder_layers(model) -> torch.nn.ModuleList:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers
