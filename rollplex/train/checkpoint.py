"""Training checkpoints (resume) and Hugging Face export.

A training checkpoint is a torch.distributed.checkpoint (DCP) directory:

    root/step_00000100/
        .metadata, __0_0.distcp, ...   model + optimizer (each rank writes its own shards)
                                       and the LR scheduler state
        rng_rank0.pt, rng_rank1.pt     RNG states (python, numpy, torch CPU, CUDA), one file per rank
        COMPLETE.json                  step, `extra`, world size and every other file's size; written last

Every rank writes into `root/.tmp-step_00000100`; after all ranks are done,
rank 0 writes COMPLETE.json and renames the folder. A crash mid-save leaves a
`.tmp-` folder, which `latest_checkpoint` skips, never a `step_` folder that
looks valid (the next run's `remove_unfinished_saves` deletes it). A save that
fails on any rank (a full disk, say) raises on every rank, deletes its `.tmp-`
folder and leaves the earlier checkpoints as they were. `root` must be on a
filesystem every rank sees, where renaming a directory is atomic (a local disk
or a POSIX shared filesystem, not an object store).

A checkpoint is complete when its COMPLETE.json reads and every file it lists
is there at its size: `latest_checkpoint` passes over a truncated or damaged
one, with a warning, to the newest complete one, and pruning counts complete
ones only, so it never deletes the last one. Sizes, not checksums: hashing
every shard on every save and load costs a full read of the checkpoint; a file
damaged in place at its size fails in `load_checkpoint` instead.

Resuming needs the model and optimizer built and parallelised the same way as
when saving: the same model args, optimizer class and param groups, and the
same `parallelize` options. With LoRA adapters a checkpoint holds the trained
parameters only (adapters, and the vision tower under lora.train_vision): the
frozen base is the model folder's, loaded from it again. The world size may differ: DCP stores each
parameter and optimizer tensor with its global shape and reshards on load (a
2-rank FSDP checkpoint loading into one plain process is tested). RNG states
are per rank, restored only on ranks that saved one, so a resumed run of
another world size does not replay the same random draws.

`export_hf` writes a standalone Hugging Face directory (weights, config,
tokenizer and processor files) that transformers and `from_pretrained` load,
each rank writing its own shards: `trainer.save_hf` at the end of a run, and
`tools/export_hf.py` for a run's checkpoint (`load_model_weights`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from rollplex.dist import all_reduce_values, full_tensor, rank
from rollplex.models.loader import CONFIG_NAME, INDEX_NAME, hub_file_index, hub_tensors
from rollplex.models.protocol import VisionLanguageModel
from rollplex.models.registry import family_of
from rollplex.train.lora import has_adapters
from rollplex.train.lora_export import merged_state_dict

MARKER = "COMPLETE.json"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"step_(\d+)")
# What export_hf copies from the source checkpoint: everything a tokenizer,
# processor or `generate` reads. Never config.json (export_hf writes one that
# matches the model) nor the weights.
HF_ASSET_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "chat_template.json", "chat_template.jinja",
    "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
    "generation_config.json",
)  # fmt: skip
HF_FILE_BYTES = 4 << 30  # export_hf's safetensors files: under the hub's 5 GB per file


@dataclass
class CheckpointState:
    """What `load_checkpoint` hands back besides the restored objects."""

    step: int
    extra: dict[str, Any] = field(default_factory=dict)


def _world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


@contextmanager
def _single_process_is_intended():
    """Outside a process group DCP warns on every call that it assumes a single
    process: that is what a non-distributed run wants."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ----------------------------------------------------------------------------- RNG


def _rng_state() -> dict[str, Any]:
    # numpy's key array is stored as a tensor so the file loads with weights_only=True.
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)), "pos": np_state["state"]["pos"],
                  "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"]},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------- save


def save_checkpoint(root: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    extra: dict[str, Any] | None = None, keep_last: int = 2,
                    group: dist.ProcessGroup | None = None) -> Path:
    """Save model, optimizer, scheduler, RNG and `extra` (JSON-serialisable, e.g. the
    data position; rank 0's copy is kept) as `root/step_{step:08d}`. Collective:
    every rank of `group` (default: all) calls it; global rank 0 must be one. Keeps
    the newest `keep_last` complete checkpoints (0: all). Returns the checkpoint's
    path; raises `CheckpointSaveError` on every rank when any rank's part failed."""
    root = Path(root)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}"
    final = root / step_dir_name(step)
    # Serialise before any work, on every rank, so a bad `extra` fails everywhere
    # at once instead of leaving the other ranks waiting in a barrier.
    marker = {"step": step, "world_size": _world_size(group), "extra": extra or {}}
    json.dumps(marker)
    if rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by a crashed save of this step; may hold shards of another world size
    _barrier(group)

    def publish() -> None:  # every rank's files are on disk: rank 0 lists them in the marker, renames the folder
        if rank() == 0:
            _publish(tmp, final, marker, keep_last)

    try:
        _every_rank_or_raise(lambda: _write_shards(tmp, model, optimizer, lr_scheduler, group), root, step, group)
        _every_rank_or_raise(publish, root, step, group)  # no rank returns (and, say, loads it) before the rename
    except CheckpointSaveError:
        if rank() == 0:  # every rank has stopped writing: the half-written folder goes, not to keep a full disk full
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; the checkpoints already on disk are untouched."""


def _every_rank_or_raise(work: Callable[[], None], root: Path, step: int, group: dist.ProcessGroup | None) -> None:
    """Run this rank's part of a save, then agree with the other ranks whether
    every part succeeded, and raise on every rank if not: a rank that gave up
    must not leave the others waiting in the save's next collective."""
    failure: BaseException | None = None
    try:
        work()
    except (Exception, CheckpointException) as e:  # DCP's derives from BaseException; re-raised below
        failure = e
    failed = failure is not None
    if dist.is_initialized():
        failed = all_reduce_values([failed], dist.ReduceOp.MAX, group)[0] > 0
    if failed:
        complete = _scan(root)[0]
        raise CheckpointSaveError(
            f"saving the checkpoint of step {step} under {root} failed {_where(failure)}. The checkpoints already "
            f"there are untouched (the newest complete one: {complete[max(complete)] if complete else 'none'}); "
            "fix the cause (a full disk?) and resume"
        ) from failure


def _where(failure: BaseException | None) -> str:
    if failure is None:
        return "on another rank"
    if isinstance(failure, CheckpointException):  # DCP's: the causes by rank, with tracebacks we leave out
        return "; ".join(f"on rank {rank}: {cause!r}" for rank, (cause, _) in failure.failures.items())
    return f"on rank {rank()}: {failure!r}"


def _write_shards(tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None, group: dist.ProcessGroup | None) -> None:
    """This rank's model and optimizer shards, the scheduler and its RNG, into `tmp`."""
    had_state = bool(optimizer.state)
    model_state, optim_state = get_state_dict(model, optimizer, options=_held_state(model))
    if not had_state:
        # Before the first step get_state_dict creates the state with a zero-lr
        # step (Adam: step=1, zero moments), which would shift bias correction
        # by one step in this run and in the checkpoint. Keep "no state yet".
        optimizer.state.clear()
        optim_state["state"] = {}
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    with _single_process_is_intended():
        dcp.save(state, checkpoint_id=tmp, process_group=group)  # creates `tmp`; collective
    torch.save(_rng_state(), tmp / f"rng_rank{rank()}.pt")


def _publish(tmp: Path, final: Path, marker: dict[str, Any], keep_last: int) -> None:
    """Rank 0: write the marker with every file's size, rename `tmp` to `final`, prune."""
    files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
    with open(tmp / MARKER, "w") as f:
        f.write(json.dumps({**marker, "files": files}, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())  # the marker must not reach the disk after the rename does
    if final.exists():
        # Saving a step twice (e.g. right after resuming from it): the new one wins.
        shutil.rmtree(final)
    tmp.rename(final)
    _prune(final.parent, marker["step"], keep_last)


def _damage(path: Path) -> str | None:
    """Why `path`, which has a marker, is not a complete checkpoint; None when it is."""
    try:
        files = json.loads((path / MARKER).read_text())["files"]
        sizes = {str(name): int(size) for name, size in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {MARKER} does not read as a file list ({e!r})"
    for name, size in sizes.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if (found := (path / name).stat().st_size) != size:
            return f"{name} has {found} bytes where {size} were written"
    return None


def _scan(root: Path) -> tuple[dict[int, Path], list[tuple[int, Path]], list[tuple[Path, str]]]:
    """(step -> complete checkpoint, [(step, half-written folder)], [(damaged checkpoint, why)]) under `root`."""
    complete, partial, damaged = {}, [], []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        m = STEP_DIR.fullmatch(p.name.removeprefix(TMP_PREFIX))
        if not (m and p.is_dir()):
            continue
        if p.name.startswith(TMP_PREFIX) or not (p / MARKER).is_file():
            partial.append((int(m.group(1)), p))
        elif (why := _damage(p)) is not None:
            damaged.append((p, why))
        else:
            complete[int(m.group(1))] = p
    return complete, partial, damaged


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Rank 0, after saving `step`: delete complete checkpoints beyond the newest
    `keep_last` (never `step` itself), and the temporary folders of crashed saves
    of earlier steps, which no writer is left to finish. Damaged checkpoints are
    left for a person to look at, and do not count."""
    complete, partial, _ = _scan(root)
    if keep_last > 0:
        for old in sorted(complete)[:-keep_last]:
            if old != step:
                shutil.rmtree(complete[old])
    for old, p in partial:
        if p.name.startswith(TMP_PREFIX) and old < step:
            shutil.rmtree(p)


def remove_unfinished_saves(root: str | Path) -> list[Path]:
    """Delete the temporary folders of saves that never finished under `root`, and return them. Only for the
    holder of the run folder's lock (rank 0, before the run's first save): then no live writer is left to finish
    them, and a save that died of a full disk would otherwise keep its space taken."""
    unfinished = [p for _, p in _scan(Path(root))[1] if p.name.startswith(TMP_PREFIX)]
    for folder in unfinished:
        shutil.rmtree(folder)
    return unfinished


# ----------------------------------------------------------------------------- load


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None.
    Half-written and damaged folders are skipped with a warning naming them."""
    complete, partial, damaged = _scan(Path(root))
    for _, p in partial:
        warnings.warn(f"ignoring incomplete checkpoint {p} (no {MARKER}: its save did not finish)", stacklevel=2)
    for p, why in damaged:
        warnings.warn(f"ignoring damaged checkpoint {p}: {why}; an earlier complete one is used", stacklevel=2)
    return complete[max(complete)] if complete else None


def _drop_unsaved_optimizer_state(optim_state: dict[str, Any], saved_keys: set[str]) -> None:
    """A parameter that never had a gradient before the save (e.g. the vision tower
    after text-only batches) has no optimizer state in the checkpoint, while the
    freshly built optimizer got state for every parameter from get_state_dict's
    zero-gradient init step. Drop those entries so DCP does not ask for missing
    keys, and so the parameter ends up stateless, as it was when saved."""
    state = optim_state["state"]
    for fqn in list(state):
        if not any(f"optimizer.state.{fqn}.{name}" in saved_keys for name in state[fqn]):
            del state[fqn]


def _held_state(model: torch.nn.Module, strict: bool = True) -> StateDictOptions:
    """What a checkpoint holds of `model`: every parameter, or with LoRA adapters the trained
    ones only (the frozen base is the model folder's, loaded from it again at resume)."""
    return StateDictOptions(ignore_frozen_params=has_adapters(model), strict=strict)


def _require_complete(path: str | Path) -> Path:
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {MARKER} is missing")
    if (why := _damage(path)) is not None:
        raise ValueError(f"{path} is damaged: {why}")
    return path


def load_model_weights(path: str | Path, model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Only the model's weights from a checkpoint written by `save_checkpoint`, in
    place, resharded to `model`'s layout (a plain model too): to export or evaluate
    it. Collective, like `load_checkpoint`."""
    path = _require_complete(path)
    state = {"model": get_model_state_dict(model, options=_held_state(model))}
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=path, process_group=group)
    set_model_state_dict(model, state["model"], options=_held_state(model, strict=False))


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    group: dist.ProcessGroup | None = None) -> CheckpointState:
    """Restore model, optimizer, scheduler and this rank's RNG from a checkpoint
    written by `save_checkpoint`. Collective. The model and optimizer must be
    built and parallelised as for saving (see the module docstring)."""
    path = _require_complete(path)
    meta = json.loads((path / MARKER).read_text())

    model_state, optim_state = get_state_dict(model, optimizer, options=_held_state(model))
    saved_keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    _drop_unsaved_optimizer_state(optim_state, saved_keys)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=path, process_group=group)  # in place, resharded to this layout
    # strict=False only lets the parameters dropped above stay without optimizer
    # state; a model key missing from the checkpoint already failed in dcp.load.
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_held_state(model, strict=False))
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])

    rng_file = path / f"rng_rank{rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        warnings.warn(f"{path} was saved by {meta['world_size']} rank(s); rank {rank()} keeps its current RNG state",
                      stacklevel=2)
    return CheckpointState(step=meta["step"], extra=meta["extra"])


# ----------------------------------------------------------------------------- Hugging Face export


def export_hf(model: VisionLanguageModel, out_dir: str | Path, source_dir: str | Path | None = None,
              dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None,
              max_file_bytes: int = HF_FILE_BYTES) -> Path:
    """Write `model` as a Hugging Face directory of its family: safetensors files of
    at most `max_file_bytes` (a tensor larger than that gets a file of its own)
    with model.safetensors.index.json, in `dtype` (default: the parameters'),
    config.json generated from the model, and the tokenizer, processor, chat
    template and generation config files of `source_dir`. Weight files already
    in `out_dir` are replaced.

    Collective: every rank of `group` calls it; global rank 0 must be one. Each
    rank writes its own shards of the weights (DCP's HuggingFaceStorageWriter,
    into `out_dir/sharded`), then rank 0 assembles the hub's files from them
    one tensor at a time, so no rank holds the whole model. The exception is a
    vision block's fused qkv, whose three parts are sharded apart: those are
    gathered, a few MB per block.

    A model with LoRA adapters is written merged, a plain model of its family:
    each adapted weight is W + (alpha / r) B A (rollplex.train.lora_export
    .merged_state_dict: computed in float32, rounded to `dtype` once, each rank
    keeping its own block), and no adapter is written."""
    out_dir = Path(out_dir)
    if source_dir is not None and out_dir.resolve() == Path(source_dir).resolve():
        # Checked on every rank, before any barrier: the export would delete the model it copies its files from.
        raise ValueError(f"the Hugging Face export folder {out_dir} is the model folder it reads: choose another")
    dtype = dtype or next(model.parameters()).dtype
    tensors = _hf_tensors(model, dtype)
    writer = HuggingFaceStorageWriter(str(out_dir), fqn_to_index_mapping=hub_file_index(tensors, max_file_bytes),
                                      save_distributed=True, enable_consolidation=True)
    shards = Path(writer.path)  # each rank's files, out_dir/sharded
    if rank() == 0:
        _remove_weight_files(out_dir, shards)
    _barrier(group)
    with _single_process_is_intended():
        dcp.save(tensors, storage_writer=writer, process_group=group)  # consolidates on rank 0 before returning
    if rank() == 0:
        shutil.rmtree(shards)
        config = _naming_dtype(family_of(model).hf_config_from_args(model.args), str(dtype).removeprefix("torch."))
        (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        for name in HF_ASSET_FILES if source_dir is not None else ():
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, out_dir / name)
    _barrier(group)
    return out_dir


def _naming_dtype(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """`config` naming `dtype` as its weights': as "dtype", which transformers 5 reads first (and from_pretrained's
    dtype="auto" loads in; a Qwen3-VL config names one at its top and in its text config), and as "torch_dtype",
    which earlier versions read."""
    config = {**config, "dtype": dtype, "torch_dtype": dtype}
    if "dtype" in config.get("text_config", {}):
        config["text_config"] = {**config["text_config"], "dtype": dtype}
    return config


def _hf_tensors(model: VisionLanguageModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights under the hub's keys, in `dtype`, each rank's shards
    left as they are (DTensors), except the fused qkv keys and stacked experts (see `export_hf`);
    LoRA adapters merged into their weights. Collective when the model is sharded."""
    ours = get_model_state_dict(model)
    if has_adapters(model):
        ours = merged_state_dict(model, ours, dtype)
    tensors = hub_tensors(family_of(model), model.args, ours, full_tensor)
    return {key: tensor.detach().to(dtype) for key, tensor in tensors.items()}


def _remove_weight_files(out_dir: Path, shards: Path) -> None:
    """An earlier export's weights: its files would otherwise stay beside the new
    ones (transformers would pick a stale model.safetensors over the index), and
    its leftover shards would be merged into the new files."""
    for old in (*out_dir.glob("*.safetensors"), out_dir / INDEX_NAME):
        old.unlink(missing_ok=True)
    shutil.rmtree(shards, ignore_errors=True)
