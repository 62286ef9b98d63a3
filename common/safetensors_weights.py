"""Weights in the Hugging Face format: safetensors files and ``save_pretrained`` folders (docs/hugging-face.md).
A file is a JSON header and raw tensor bytes: nothing is unpickled, so nothing runs. ``--init-from`` reads them
through DCP's own reader for these files (as torchtitan loads Hub weights), so a sharded model is never whole on any
rank. ``write_pretrained`` writes a run's final model and ``tools.runs.export_checkpoint --hf-config``'s."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from common.distributed import (
    DistContext,
    FatalError,
    broadcast_object,
    max_over_ranks,
    print0,
    quiet_internal_warnings,
)
from common.fine_tuning import is_adapter
from common.models import tied_parameters, unwrapped
from common.outputs import output_folder, write_by_name, write_text

SUFFIX = ".safetensors"
WEIGHTS_FILE = "model.safetensors"  # what save_pretrained writes for a model of one file
INDEX_FILE = "model.safetensors.index.json"  # for a model in several files: which file holds which tensor
CONFIG_FILE = "config.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")  # the format before safetensors
# A model's attribute: {its name: the name its files give the tensor}, where they differ (a Hugging Face model's own
# renaming on load, as GPT-NeoX's embed_out.weight for lm_head.weight; examples/hf_model.py sets it).
NAMES_IN_FILES = "names_in_files"

Header = dict[str, tuple[tuple[int, ...], torch.dtype]]  # a tensor's shape and dtype, by name


def holds_safetensors(path: Path) -> bool:
    """``path`` is a ``.safetensors`` file, or a folder of them: weights for ``start_from_safetensors``."""
    if path.is_dir():
        return (path / INDEX_FILE).exists() or any(path.glob(f"*{SUFFIX}"))
    return path.suffix == SUFFIX


def safetensors_files(path: Path) -> list[Path]:
    """The files ``--init-from PATH`` reads: the file itself; in a folder, the files its index names,
    or without an index every ``.safetensors`` in it. ValueError says why there are none to read."""
    if not path.is_dir():
        return [path]
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"has a {INDEX_FILE} that is no index of safetensors files ({err})") from None
        missing = [name for name in names if Path(name).name != name or not (path / name).is_file()]
        if missing:
            raise ValueError(f"has a {INDEX_FILE} that names {', '.join(missing)}, which the folder does not hold")
        return [path / name for name in names]
    files = sorted(path.glob(f"*{SUFFIX}"))
    if not files:
        pickled = [name for name in PICKLED_WEIGHTS if (path / name).exists()]
        hint = (
            f": {pickled[0]} is a pickle, which can run code when loaded. Give that file itself to --init-from "
            "(it is read with torch.load(weights_only=True), which refuses anything but tensors), or convert it "
            "to safetensors where you trust it"
            if pickled
            else ""
        )
        raise ValueError(f"is a folder with no {SUFFIX} file and no {INDEX_FILE}{hint}")
    return files


def read_header(files: list[Path]) -> Header:
    """Each tensor's shape and dtype, from the files' headers alone (no tensor is read)."""
    from safetensors import safe_open
    from safetensors.torch import _getdtype  # the package's own table of its dtype names

    header: Header = {}
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            for name in opened.keys():  # noqa: SIM118 - a safetensors handle is no dict
                if name in header:
                    raise ValueError(f"holds {name} in two of its files")
                piece = opened.get_slice(name)
                header[name] = (tuple(piece.get_shape()), _getdtype(piece.get_dtype()))
    return header


def exactly_representable(stored: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of ``stored`` converts to ``target`` without change: bf16 and fp16 into fp32 do
    (the usual Hub checkpoint into a model trained in fp32), fp32 into bf16 and any float into an int do not."""
    if stored == target:
        return True
    if stored.is_floating_point and target.is_floating_point:
        wide, fine = torch.finfo(stored), torch.finfo(target)
        return wide.max <= fine.max and wide.eps >= fine.eps and wide.tiny >= fine.tiny
    return False


def first_few(items: list[str], shown: int = 3) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def weights_problem(found: Header, expected: Header, tied: dict[str, str]) -> str | None:
    """Why weights of ``found``'s names, shapes and dtypes do not fit a model of ``expected``'s; None if they do.
    A tied name (``tied``: alias -> the name it is) may be left out, as a Hugging Face folder leaves it out."""
    missing = [name for name in expected if name not in found and not (name in tied and tied[name] in found)]
    unexpected = [name for name in found if name not in expected]
    reshaped = [
        f"{name} is {list(found[name][0])} there, {list(shape)} here"
        for name, (shape, _) in expected.items()
        if name in found and found[name][0] != shape
    ]
    retyped = [
        f"{name} is {str(found[name][1]).removeprefix('torch.')} there, {str(dtype).removeprefix('torch.')} here"
        for name, (shape, dtype) in expected.items()
        if name in found and found[name][0] == shape and not exactly_representable(found[name][1], dtype)
    ]
    kinds = ("missing", "not in this model", "other shapes", "dtypes that do not convert exactly")
    lists = (missing, unexpected, reshaped, retyped)
    parts = [f"{what}: {first_few(names)}" for what, names in zip(kinds, lists, strict=True) if names]
    return f"does not fit this model ({'; '.join(parts)})" if parts else None


def tied_tensors(files: list[Path], tied: dict[str, str], in_files: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors ``files`` hold under the names of a tied pair (``in_files``: as the files name them): both, where
    the files store it twice; by the model's names."""
    from safetensors import safe_open

    wanted = {in_files.get(name, name): name for pair in tied.items() for name in pair}
    stored: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            stored |= {wanted[name]: opened.get_tensor(name) for name in opened.keys() if name in wanted}  # noqa: SIM118
    return stored


def untied_problem(stored: dict[str, torch.Tensor], tied: dict[str, str]) -> str | None:
    """A pair the model ties that ``stored`` holds as two different tensors: one tensor cannot be both."""
    for alias, source in tied.items():
        if alias in stored and source in stored and not torch.equal(stored[alias], stored[source]):
            return (
                f"holds {alias} and {source} as two different tensors, but this model ties them (one tensor under "
                "both names): the weights are of an untied model"
            )
    return None


def tie_hint(path: Path, problem: str, tied: dict[str, str]) -> str:
    """The model's tying, where the folder's config.json ties otherwise: the likely reason for a missing name."""
    config = (path if path.is_dir() else path.parent) / CONFIG_FILE
    try:
        ties = json.loads(config.read_text()).get("tie_word_embeddings")
    except (OSError, ValueError, AttributeError):
        return problem
    if ties and not tied:
        return f"{problem}. Its config.json ties the output head to the token embedding; this model ties nothing"
    return problem


def counting_reader(files: list[Path]) -> Any:
    """DCP's reader of safetensors files, kept to ``files``, counting the bytes this rank reads."""
    # Imported here: on torch releases without it everything else still runs (docs/torch-versions.md).
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    wanted = {file.resolve() for file in files}

    class Reader(HuggingFaceStorageReader):
        def __init__(self) -> None:
            super().__init__(str(files[0].parent))
            # It would read every file its file system lists in the folder: a stray or broken .safetensors, or a
            # folder of several models. This reader's own file system lists only ``files``.
            listed = self.fs.ls
            self.fs.ls = lambda path: [name for name in listed(path) if Path(name).resolve() in wanted]
            self.bytes_read = 0

        def read_data(self, plan: Any, planner: Any) -> Any:
            for item in plan.items:
                self.bytes_read += math.prod(item.lengths) * self.storage_data[item.storage_index].dtype.itemsize
            return super().read_data(plan, planner)

    return Reader()


def start_from_safetensors(model: torch.nn.Module, path: Path, ctx: DistContext) -> None:
    """--init-from a ``save_pretrained`` folder or a ``.safetensors`` file, into the wrapped ``model``. DISTRIBUTED:
    rank 0 checks the headers against the model (names, shapes, dtypes, tying), every rank stops with one message if
    they do not fit; then each rank reads the slices it keeps. LoRA adapters are not in such weights (no change)."""
    tied, in_files = tied_parameters(model), getattr(unwrapped(model), NAMES_IN_FILES, {})
    with quiet_internal_warnings():  # FSDP1's sharded state dict still goes through ShardedTensor
        state = get_model_state_dict(model)
        expected = {name: (tuple(t.size()), t.dtype) for name, t in state.items() if not is_adapter(name)}
    problem, files, read = None, [], []
    if ctx.is_main:
        try:
            files = safetensors_files(path)
            model_names = {file_name: name for name, file_name in in_files.items()}
            header = {model_names.get(name, name): value for name, value in read_header(files).items()}
        except ValueError as err:  # the files as a whole: none there, missing from an index, a tensor in two
            problem = str(err)
        except Exception as err:  # noqa: BLE001 - any failure to read a file is one message, below
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            problem = f"cannot be read ({type(err).__name__}: {first_line})"
        else:
            problem = weights_problem(header, expected, tied) or untied_problem(
                tied_tensors(files, tied, in_files), tied
            )
            problem = problem and tie_hint(path, problem, tied)
            # A tied pair stored twice holds one value (checked above): read it once, under the first name.
            read = [name for name in expected if name in header and not (name in tied and tied[name] in header)]
    problem, files, read = broadcast_object((problem, files, read))
    if problem is not None:
        raise FatalError(f"--init-from {path} {problem}")
    reader = counting_reader(files)
    with quiet_internal_warnings():
        dcp.load({in_files.get(name, name): state[name] for name in read}, storage_reader=reader)
        for alias, source in tied.items():
            state[alias] = state[source]
        set_model_state_dict(model, state)
    total = sum(math.prod(expected[name][0]) * expected[name][1].itemsize for name in read)
    (most,) = max_over_ranks([float(reader.bytes_read)], ctx)
    print0(
        f"weights from {path} ({len(read)} tensors, {total / 2**20:.1f} MiB; each rank read at most "
        f"{100 * most / total:.0f}% of them); a new run: step 0, a fresh optimizer"
    )


def pretrained_folder(path: Path) -> bool:
    """A folder that holds a ``save_pretrained`` model and nothing else: one that --overwrite may replace."""
    allowed = {CONFIG_FILE, INDEX_FILE, "generation_config.json"}
    return path.is_dir() and all(
        entry.is_file() and (entry.name in allowed or entry.suffix == SUFFIX) for entry in path.iterdir()
    )


def write_pretrained(
    state: dict[str, torch.Tensor], folder: Path, config_text: str, tied: dict[str, str], overwrite: bool
) -> None:
    """``folder`` as ``save_pretrained`` writes it: ``config.json`` and ``model.safetensors``, whole or not at all.
    ``state``: the whole model on the CPU; each alias in ``tied`` is left out, as the Hub's files leave it out."""
    from safetensors.torch import save_file

    tensors = {name: tensor.contiguous() for name, tensor in state.items() if name not in tied}
    config = json.loads(config_text)
    dtypes = {tensor.dtype for tensor in tensors.values() if tensor.is_floating_point()}
    if len(dtypes) == 1:  # the config says the tensors' dtype, as save_pretrained's does
        config["dtype"] = str(dtypes.pop()).removeprefix("torch.")
        config.pop("torch_dtype", None)  # the older name of the same field
    with output_folder(folder, overwrite, replaceable=pretrained_folder) as temporary:
        write_by_name(temporary / WEIGHTS_FILE, lambda name: save_file(tensors, name, metadata={"format": "pt"}), False)
        write_text(temporary / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n", False)
