"""A tensor-parallel rank's shard of a safetensors checkpoint, read without the rest.

Loading the whole model in host memory and then cutting it (:func:`~.tensor_parallel.
shard_layers`) costs each rank the whole checkpoint in RAM at once: a 70B bf16 model at
tp=2 puts 2 x 129 GiB on the node while it loads. Here a rank builds the model's modules
with their weights allocated but never written (transformers' ``no_init_weights``: the
host's pages are not touched, so not committed), cuts the layers with the same
:func:`~.tensor_parallel.shard_layers` the executor uses, which records each cut
parameter's slice, and then fills every parameter from the checkpoint's files with
safetensors' ``get_slice``: a cut parameter reads only its rows or columns, the
replicated ones (embedding, norms, LM head) read whole. A checkpoint whose names do not
cover the model's parameters is refused here (None), and the caller loads it whole.

The modules are built with their weights on the meta device (shapes only), so neither the
cut nor the fill copies anything thrown away; where the checkpoint's dtype is the one
asked, a parameter is the file's own pages, mapped (as transformers' own loading does):
the process then holds the shard in the page cache, shared with the node's other ranks,
and no anonymous copy.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from raycolo.engine.executor.tensor_parallel import TensorParallel, check_tp, shard_layers
from raycolo.errors import ConfigError

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (none: not a safetensors checkpoint)."""
    index = path / INDEX_FILE
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [path / SINGLE_FILE] if (path / SINGLE_FILE).exists() else []


def _cut(sliced, param: torch.Tensor) -> torch.Tensor:
    """The part of a checkpoint tensor (a safetensors slice) that ``param`` holds."""
    cut = getattr(param, "tp_slice", None)
    if cut is None:
        return sliced[:]
    dim, start, stop = cut
    return sliced[start:stop] if dim == 0 else sliced[:, start:stop]


def _to_meta(model) -> None:
    """Every parameter of ``model`` on the meta device (shape only; tied ones stay tied):
    the cut and the fill then copy nothing that is thrown away."""
    metas: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in metas:
                    metas[id(p)] = torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
                module._parameters[name] = metas[id(p)]


def _like(param: torch.nn.Parameter, value: torch.Tensor) -> torch.nn.Parameter:
    """``value`` as a parameter that takes ``param``'s place (with its recorded slice)."""
    out = torch.nn.Parameter(value, requires_grad=param.requires_grad)
    if hasattr(param, "tp_slice"):
        out.tp_slice = param.tp_slice
    return out


def _replace(model, loaded: dict) -> None:
    """Each meta parameter of ``model`` replaced by the one read for it (ties kept)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = loaded[id(p)]


def load_shard(model_id: str, dtype: str, tp: TensorParallel):
    """``tp.rank``'s shard of the checkpoint directory ``model_id`` in host memory, as a
    transformers model whose decoder layers are already cut (the executor leaves them as
    they are); None where ``model_id`` is no safetensors checkpoint directory or its
    tensors' names are not the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from safetensors import safe_open

    from raycolo.engine.executor.model import FAST_PATH_FAMILIES
    from raycolo.engine.models import torch_dtype

    path = Path(model_id)
    files = checkpoint_files(path) if path.is_dir() else []
    if not files:
        return None
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in FAST_PATH_FAMILIES:
        return None            # no fast path: loaded whole, and refused by the engine's checks
    try:
        check_tp(config, tp.world)
    except ConfigError:
        return None            # the engine refuses it, naming its own field
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype)).eval()
    _to_meta(model)
    shard_layers(model.model.layers, config, tp)
    want = torch_dtype(dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[int, torch.nn.Parameter] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                param = params.get(key)
                if param is None or id(param) in loaded:
                    continue          # a buffer the model rebuilds (rotary frequencies), a tied copy
                value = _cut(f.get_slice(key), param)
                if value.shape != param.shape:
                    log.info("%s: %s is %s in the checkpoint, %s in the model; loading it whole",
                             model_id, key, tuple(value.shape), tuple(param.shape))
                    return None
                # the file's own pages where the dtype is the model's (mapped, not copied)
                loaded[id(param)] = _like(param, value.to(want).contiguous())
    missing = [k for k, p in params.items() if id(p) not in loaded]
    if missing:
        log.info("%s: the checkpoint lacks %s; loading it whole", model_id, missing[:3])
        return None
    _replace(model, loaded)
    shard_layers(model.model.layers, config, tp)    # again: rank > 0's row-parallel biases zeroed
    return model


def load_rank_model(model_id: str, seed: int, dtype: str, tp: TensorParallel):
    """(model, tokenizer) for a tensor-parallel rank, in host memory: only its shard read
    where the checkpoint allows (:func:`load_shard`), else the whole model (a catalog's
    tiny model, another checkpoint format), which the executor then cuts."""
    from raycolo.engine.models import checkpoint_tokenizer, load_model

    model = load_shard(model_id, dtype, tp) if tp.world > 1 else None
    if model is None:
        return load_model(model_id, seed, dtype, "cpu")
    return model, checkpoint_tokenizer(Path(model_id), model.config.vocab_size)
