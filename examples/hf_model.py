"""A Hugging Face causal language model (Llama, Qwen, Mistral, GPT-2, ...) in a copy of a transformer script.

Copy this file beside your copy of ddp/train_transformer.py, fsdp/train_transformer.py or
fsdp/train_transformer_fsdp2.py; docs/hugging-face.md gives each line to change in the copy. The
model's architecture comes from the config.json of the folder the run starts from (--init-from), so
every run starts from that folder's weights: a pretrained model, or one you made with
``AutoModelForCausalLM.from_config(config).save_pretrained(folder)`` to train from scratch.

This file imports transformers; the scripts and common/ never do. What it needs of the library:
``CONFIG_MAPPING`` (the config class of each model_type), ``AutoModelForCausalLM`` and a model's own ``_init_weights``
for its buffers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from common.distributed import DistContext, FatalError
from common.models import tied_parameters
from common.run_dir import PRETRAINED_DIR
from common.safe_io import save_model_folder
from common.safetensors_weights import CONFIG_FILE, NAMES_IN_FILES

# The text of each --init-from's config.json as the run read it, before it built the model: what RUN_DIR/hf gets at
# the end, whatever the folder holds by then (another export with --overwrite may have replaced it meanwhile).
CONFIGS_AS_READ: dict[Path, str] = {}
# Config fields that are no part of the model's shape: a resume may change them.
NOT_THE_SHAPE = {"use_cache", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "architectures"}


def config_folder(init_from: Path | None) -> Path:
    """The folder whose config.json describes the model: --init-from's, or the folder of its .safetensors file."""
    if init_from is None:
        raise FatalError(
            "a Hugging Face model is built from the config.json of the folder it starts from: give --init-from "
            "FOLDER (a save_pretrained folder)"
        )
    folder = init_from if init_from.is_dir() else init_from.parent
    if not (folder / CONFIG_FILE).is_file():
        raise FatalError(f"--init-from {init_from}: {folder} has no {CONFIG_FILE} to build the model from")
    return folder


def hf_config(init_from: Path | None, dropout: float) -> PretrainedConfig:
    """The config of the model to train: every dropout probability it names set to --dropout (the scripts'
    default, 0, is what --deterministic and the equivalence checks need), and no key-value cache, which only
    generation reuses. FatalError for a config of a model that is no causal language model."""
    folder = config_folder(init_from)
    try:
        text = (folder / CONFIG_FILE).read_text()
        fields = json.loads(text)
        config = CONFIG_MAPPING[fields["model_type"]].from_dict(fields)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FatalError(f"{folder / CONFIG_FILE} cannot be read as a Hugging Face config ({err!r})") from None
    CONFIGS_AS_READ[init_from] = text
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise FatalError(
            f"{folder / CONFIG_FILE} describes a {config.model_type} model, which is no causal language model "
            "(AutoModelForCausalLM builds none of that type): these scripts train next-token prediction"
        )
    for name, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop")):
            setattr(config, name, dropout)
    config.use_cache = False
    return config


def causal_lm(config: PretrainedConfig, vocab_size: int, block_size: int) -> PreTrainedModel:
    """The model of ``config``, in fp32, on the current device: the meta device inside the FSDP scripts'
    ``with torch.device("meta")`` (shapes alone; every rank fills its own shards), else built whole with the
    library's own initialisation. FatalError where the data's tokens or sequences do not fit it."""
    if vocab_size > config.vocab_size:
        raise FatalError(
            f"the data's tokens go up to {vocab_size - 1}, past this {config.model_type} model's vocabulary of "
            f"{config.vocab_size}: give it tokens of its own tokenizer"
        )
    longest = getattr(config, "max_position_embeddings", None)
    if longest is not None and block_size > longest:
        raise FatalError(f"--block-size {block_size} is longer than this model's {longest} positions")
    # fp32 whatever the folder's dtype: the weights the optimizer updates stay fp32 (--mixed-precision computes lower).
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    setattr(model, NAMES_IN_FILES, names_in_files(model))  # what --init-from reads each tensor as
    return model


def names_in_files(model: PreTrainedModel) -> dict[str, str]:
    """Each name of the model's state dict that its files give another name (GPT-NeoX's ``lm_head.weight`` is
    ``embed_out.weight`` there): transformers' own reverse of the renaming it applies on load, as ``save_pretrained``
    writes. FatalError for a family whose files hold its tensors in another layout (Mixtral's experts one by one,
    merged on load): these scripts read a file's tensors by name, as they are."""
    markers = {name: torch.empty_like(tensor, device="meta") for name, tensor in model.state_dict().items()}
    written = revert_weight_conversion(model, dict(markers))
    names = {id(marker): name for name, marker in markers.items()}
    if len(written) != len(markers) or any(id(tensor) not in names for tensor in written.values()):
        raise FatalError(
            f"{type(model).__name__} is stored in its files in another layout than the model holds (transformers "
            f"converts {len(written)} tensors there into {len(markers)} on load): these scripts read each tensor "
            "by its name, as stored, so they cannot train this family"
        )
    return {names[id(tensor)]: name for name, tensor in written.items() if names[id(tensor)] != name}


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The model's repeated layers (``model.layers`` of Llama, ``transformer.h`` of GPT-2): FSDP's units."""
    count = model.config.num_hidden_layers
    found = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == count), None)
    if found is None:
        raise FatalError(f"{type(model).__name__} has no list of its {count} layers to make FSDP units of")
    return found


@torch.no_grad()
def refuse_if_not_causal(model: nn.Module, device: torch.device) -> None:
    """Next-token prediction needs a model whose output at a position sees no later token: two sequences that
    differ only in their second token must score their first alike. FatalError where they do not, as for an
    encoder with a language-model head (BERT without ``is_decoder``), whose training would see each answer.
    Every rank runs the same small forward (under FSDP it gathers the units as any forward does)."""
    tokens = torch.tensor([[1, 2], [1, 3]], device=device)
    training = model.training
    model.eval()
    logits = model(tokens).logits.float()
    model.train(training)
    if not torch.allclose(logits[0, 0], logits[1, 0], rtol=1e-5, atol=1e-6):
        raise FatalError(
            f"{type(model).__name__} is no causal language model: its output at a position depends on later "
            "tokens, which these scripts train it to predict (a BERT-like model needs is_decoder: true in its "
            "config.json)"
        )


def model_shape(config: PretrainedConfig) -> dict[str, Any]:
    """What the checkpoints record of the model: its config without the fields a resume may change."""
    return {
        name: value
        for name, value in config.to_dict().items()
        if name not in NOT_THE_SHAPE and not ("dropout" in name or name.endswith("pdrop"))
    }


@torch.no_grad()
def restore_buffers(model: nn.Module) -> None:
    """Compute again the buffers that no file holds (non-persistent ones, as Llama's rotary frequencies), which
    ``to_empty`` left without values: the model's own ``_init_weights``, on a copy of each module that holds
    them. FatalError where it does not compute one, rather than train on what the memory held."""
    pretrained = next(module for module in model.modules() if isinstance(module, PreTrainedModel))
    for module in model.modules():
        names = [name for name in module._non_persistent_buffers_set if module._buffers.get(name) is not None]
        if not names:
            continue
        twin = copy_with_buffers(module, names)
        pretrained._init_weights(twin)
        for name in names:
            value = twin._buffers[name]
            if value.is_floating_point() and value.isnan().any():
                raise FatalError(
                    f"{type(pretrained).__name__}'s own initialisation does not compute the buffer {name} of "
                    f"{type(module).__name__}: restore it after to_empty yourself"
                )
            module._buffers[name].copy_(value)


def copy_with_buffers(module: nn.Module, names: list[str]) -> nn.Module:
    """A shallow copy of ``module`` whose buffers ``names`` are new tensors, NaN until something sets them, and
    whose parameters are shapes alone: an initialisation run on it changes nothing of ``module``."""
    twin = type(module).__new__(type(module))
    twin.__dict__ = dict(module.__dict__)
    twin._buffers = {
        name: torch.full_like(buffer, math.nan) if name in names and buffer.is_floating_point() else buffer.clone()
        for name, buffer in module._buffers.items()
    }
    own = module.named_parameters(recurse=False)
    twin._parameters = {name: nn.Parameter(torch.empty(parameter.shape, device="meta")) for name, parameter in own}
    return twin


def to_empty_keeping_ties(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device, recurse=False)`` for FSDP1's materialisation, one module at a time, but
    a parameter that two modules share (a tied weight) stays one tensor: the second module gets the tensor the
    first one made. ``to_empty`` would give each its own."""
    for name, parameter in list(module.named_parameters(recurse=False)):
        if parameter.is_meta:
            if not hasattr(parameter, "materialized"):
                parameter.materialized = nn.Parameter(
                    torch.empty_like(parameter, device=device), requires_grad=parameter.requires_grad
                )
            module._parameters[name] = parameter.materialized
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer.is_meta:
            module._buffers[name] = torch.empty_like(buffer, device=device)


def save_pretrained(
    state: dict[str, torch.Tensor] | None, model: nn.Module, init_from: Path, run_dir: Path, ctx: DistContext
) -> None:
    """RUN_DIR/hf: the final model as a folder ``from_pretrained`` loads, from the state dict model.pt holds,
    with the config.json of the folder the run started from, as ``hf_config`` read it (its dropouts as they were)."""
    config_text = CONFIGS_AS_READ[init_from]
    pretrained = next(module for module in model.modules() if isinstance(module, PreTrainedModel))
    in_files = getattr(pretrained, NAMES_IN_FILES)  # as causal_lm found them, on the model before it was wrapped
    state = state and {in_files.get(name, name): tensor for name, tensor in state.items()}
    tied = {in_files.get(alias, alias): in_files.get(name, name) for alias, name in tied_parameters(model).items()}
    save_model_folder(state, run_dir / PRETRAINED_DIR, config_text, tied, ctx)
