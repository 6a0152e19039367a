"""Export a policy to an HF folder: at the end of a fit, or from any checkpoint (``python -m sgrpo.export``).

``python -m sgrpo.export CKPT OUT [--merged] [--base MODEL]`` reads a single-process Lightning checkpoint
(``.ckpt``), a sharded FSDP2 checkpoint (a folder written by ``torch.distributed.checkpoint``: its model
shards are gathered into one state dict in this process, the optimiser's are not read) or a LoRA
checkpoint, and writes what a fit's end writes: the model (``from_pretrained`` with transformers alone),
or for LoRA the PEFT adapter folder and, with ``--merged``, the merged model in ``OUT/merged``.

The base model, its dtype and the LoRA settings are recorded in every checkpoint (``checkpoint["sgrpo"]
["policy"]``); Lightning stores no hyperparameters for the policy, and its ``config.yaml`` lies in a
logger's folder (somewhere else under W&B) with paths relative to where the fit ran. A checkpoint saved
before that record falls back to the run's newest ``lightning_logs/version_N/config.yaml``, then to
``--base``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn

from sgrpo.checks import exit_with_error
from sgrpo.distributed import leave_process_group
from sgrpo.model.loading import largest_magnitude, load_causal_lm, resolve_model_path
from sgrpo.model.lora import LoRA, adapter_state, apply_lora, is_adapter, merged_state, save_adapter
from sgrpo.run.checkpoints import EXPORT_MARK, PARTIAL, checkpoint_problem, hidden_name, remove_path, replace_folder
from sgrpo.run.faults import FAILING, announce, disk_fault, disk_words
from sgrpo.run.folders import logger_versions
from sgrpo.run.signals import Stopped, forward_signal


class CheckpointError(Exception):
    """A checkpoint that cannot be read or exported as asked; the message says why in one line."""


def policy_record(model_path: str, dtype: str, peft: LoRA | None) -> dict[str, Any]:
    """What a checkpoint records to be exported on its own: the base model (a local folder made absolute,
    or a hub id), the dtype and the LoRA settings."""
    base = resolve_model_path(model_path)
    base = str(Path(base).resolve()) if Path(base).is_dir() else base
    return {"base": base, "dtype": dtype, "peft": asdict(peft) if peft is not None else None}


def save_hf(model: nn.Module, tokenizer, path: Path, state_dict: dict[str, Tensor] | None = None) -> Path:
    """``save_pretrained`` of the model (or of ``state_dict`` in its place) and the tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=state_dict)
    # FSDP2 swaps in a subclass named FSDP<Model>: record the model's own class
    own = next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [own.__name__]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def save_policy(model, tokenizer, path: Path, peft: LoRA | None, base: str, merged: bool, leader: bool = True,
                sharded: bool = False) -> None:  # fmt: skip
    """The trained policy to ``path``: the model, or with LoRA the adapter folder (and the merged model in
    ``path/merged`` if ``merged``). Sharded weights are gathered, a collective: every process calls this,
    and the ``leader`` alone keeps the merged copy and writes. Weights that are not all finite are refused
    (``CheckpointError``): a diverged model is no model to deploy."""
    if not bool(torch.isfinite(largest_magnitude(model.parameters()))):
        raise CheckpointError(f"the model's weights are not all finite (NaN or infinite): {path} was not written")
    if peft is not None:
        adapter = adapter_state(model)
        full = merged_state(model, keep=leader) if merged else None  # gathered by all, kept by the leader
        if leader:
            save_adapter(adapter, peft, base, path)
            tokenizer.save_pretrained(path)
            if full is not None:
                save_hf(model, tokenizer, path / "merged", full)
        return
    state = None
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        aliases = tied_aliases(model)
        state = {name: tensor for name, tensor in state.items() if name not in aliases}
    if leader:
        save_hf(model, tokenizer, path, state)


def tied_aliases(model: nn.Module) -> set[str]:
    """The second and later names of a parameter the model holds under several (a tied LM head): a full state dict
    gathered from FSDP2 holds a copy under each name, which ``save_pretrained`` would write twice."""
    seen, aliases = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def stop_every_process(trainer) -> Callable[[int, str], None]:
    """What a signal during the export tells the other processes: it is forwarded to those Lightning's launcher
    started, and with several processes posted in the store, where the fault watch of a process still in the
    export ends it (exit 1) within a second, and the final barrier of one past it stops waiting
    (``sgrpo.distributed.release_process_group``). The export is a collective under FSDP2 (the full state dict's
    gather): the others waited in it for the process group's timeout; under DDP, in the final barrier."""

    def stop(signum: int, name: str) -> None:
        forward_signal(trainer)(signum)
        if trainer.world_size > 1:
            FAILING.set()  # this process leaves by its own exception (143 / 130), not by its watch
            announce(f"process {trainer.global_rank} was stopped by {name} during the export")
            leave_process_group(f"was stopped by {name} during the export")  # DDP: the others are past the export

    return stop


class ExportInterrupted(Stopped):
    """SIGTERM or Ctrl-C while a fit's end or ``python -m sgrpo.export`` wrote the policy: nothing was put in place
    (exit 143 / 130)."""


#: how to export again after a fit's export was cut short (a fit's end exports once its last step is done)
RESUME_TO_EXPORT = "the checkpoints are whole: resume with --ckpt_path last to export again"


@contextmanager
def staged_export(path: Path, leader: bool = True, others: Callable[[int, str], None] | None = None,
                  again: str = RESUME_TO_EXPORT, in_place: bool = False) -> Iterator[Path]:  # fmt: skip
    """Where to write an export that lands at ``path`` whole or not at all: a hidden folder beside it
    (``.NAME.partial``), swapped in once complete (``replace_folder``). A SIGTERM or Ctrl-C meanwhile (from the main
    thread) stops the write, says so and how to export ``again``, tells the other processes (``others(signum, name)``)
    and raises ``ExportInterrupted``; ``path`` is left as it was (as it is when the write fails). ``in_place``: one
    process writes into ``path`` itself, an existing empty folder (a mount point, the current folder, one whose
    parent it cannot write to: none can be swapped), emptied again if the write fails."""
    staged = path if in_place else hidden_name(path, PARTIAL)
    previous: dict[int, Any] = {}

    def interrupted(signum: int, frame) -> None:
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        print(f"\n{name} during the export to {path}: it was not written; {again}", file=sys.stderr, flush=True)
        if others is not None:
            others(signum, name)
        raise ExportInterrupted(signum)

    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if leader and not in_place:
            remove_path(staged)  # a cut export's
            path.parent.mkdir(parents=True, exist_ok=True)
        yield staged
        if leader and not in_place:
            replace_folder(staged, path)
    except BaseException:
        for signum in previous:  # a second Ctrl-C / SIGTERM must not cut the clean-up short (the handlers come back)
            signal.signal(signum, signal.SIG_IGN)
        if leader and in_place:
            for child in list(staged.iterdir()):
                remove_path(child)
        elif leader:
            remove_path(staged)
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class PolicyExport:
    """Mixin of ``GRPOPolicy``: the export at the end of a fit, and the record its checkpoints keep."""

    @property
    def export_path(self) -> Path:
        """Where fit's end writes the trained model (the adapter folder with LoRA): ``export_dir`` or
        ``<run folder>/hf_model``."""
        return Path(self.export_dir or Path(self.trainer.default_root_dir) / "hf_model")

    def on_fit_end(self) -> None:
        self.divergence_watch.finish(self.rollout_step)  # a run that ended on skipped (non-finite) steps: no export
        base = self.policy_record()["base"]
        merged = self.peft is not None and self.peft.export_merged
        leader = self.trainer.is_global_zero
        with staged_export(self.export_path, leader, stop_every_process(self.trainer)) as staged:
            save_policy(self.model, self.tokenizer, staged, self.peft, base, merged, leader=leader,
                        sharded=self.device_mesh is not None)  # fmt: skip
            if leader:  # the mark that lets a later export replace this folder (run.preflight.check_export_dir)
                mark = {"run": str(Path(self.trainer.default_root_dir).absolute()), "step": self.rollout_step}
                (staged / EXPORT_MARK).write_text(json.dumps(mark | {"base": base}) + "\n")

    def policy_record(self) -> dict[str, Any]:
        """The base model, dtype and LoRA settings: what a checkpoint needs to be exported on its own. The
        dtype is the weights' as trained: a "-true" precision converts them from ``model.dtype``."""
        weight = next(self.model.parameters(), None) if self.model is not None else None
        dtype = str(weight.dtype).removeprefix("torch.") if weight is not None else self.model_dtype
        return policy_record(self.model_path, dtype, self.peft)


def open_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint file (its tensors memory-mapped), or a sharded folder's ``meta.pt`` (all but the weights)."""
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    if path.is_dir() and not (path / ".metadata").is_file():
        hint = ": an HF model folder already" if (path / "config.json").is_file() else ""
        raise CheckpointError(f"{path} is a folder but not a sharded checkpoint (no .metadata){hint}")
    problem = checkpoint_problem(path)
    if problem:
        raise CheckpointError(f"{path} does not load: {problem}")
    checkpoint = torch.load(path / "meta.pt" if path.is_dir() else path, map_location="cpu", mmap=not path.is_dir())
    if not isinstance(checkpoint, dict) or not (path.is_dir() or "state_dict" in checkpoint):
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no state_dict)")
    return checkpoint


def read_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The policy model's weights (its own parameter names) and the rest of a checkpoint, file or sharded folder."""
    checkpoint = open_checkpoint(path)
    weights = _read_shards(path) if path.is_dir() else checkpoint["state_dict"]
    return {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}, checkpoint


def recorded_policy(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The ``policy_record`` a checkpoint holds (None in one saved before sgrpo recorded it)."""
    return (checkpoint.get("sgrpo") or {}).get("policy")


def _read_shards(path: Path) -> dict[str, Tensor]:
    """The model entries of a distributed checkpoint (Lightning saves them under ``state_dict``), loaded whole."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    wanted = {
        key.removeprefix("state_dict."): torch.empty(meta.size, dtype=meta.properties.dtype, device="cpu")
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("state_dict.") and isinstance(meta, dcp.TensorStorageMetadata)
    }
    state = {"state_dict": wanted}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["state_dict"]


def policy_of(path: Path, checkpoint: dict[str, Any], base: str | None) -> dict[str, Any]:
    """The checkpoint's ``policy_record``: its own, else its run's newest ``config.yaml``; ``base`` overrides."""
    record = recorded_policy(checkpoint) or _from_run_config(path)
    if record is None and base is None:
        raise CheckpointError(
            f"{path} does not name its base model (a checkpoint from before sgrpo recorded it, and no "
            f"lightning_logs/version_N/config.yaml beside its checkpoints folder): give it with --base"
        )
    record = dict(record or {"dtype": "float32", "peft": None})
    if base is not None:
        record["base"] = base
    return record


def _from_run_config(path: Path) -> dict[str, Any] | None:
    run = path.resolve().parent.parent  # <run>/checkpoints/<checkpoint>
    for config in reversed(logger_versions(run, "config.yaml")):
        model = (yaml.safe_load(config.read_text()) or {}).get("model") or {}
        if model.get("model"):
            return {"base": model["model"], "dtype": model.get("dtype", "float32"), "peft": model.get("peft")}
    return None


def load_policy(weights: dict[str, Tensor], record: dict[str, Any]):
    """The base model with the checkpoint's weights (and LoRA adapters), and its tokenizer."""
    from transformers import AutoTokenizer

    base = resolve_model_path(record["base"])
    try:
        model = load_causal_lm(base, getattr(torch, record["dtype"]))
        tokenizer = AutoTokenizer.from_pretrained(base)
    except (OSError, ValueError) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"cannot load the base model {record['base']} ({why}): give it with --base") from None
    peft = LoRA(**record["peft"]) if record.get("peft") else None
    if peft is None and any(is_adapter(k) for k in weights):
        raise CheckpointError("the checkpoint holds LoRA adapters but its record has no LoRA settings")
    if peft is not None:
        peft, weights = without_head_adapters(model, peft, weights)
        try:
            apply_lora(model, peft)
        except ValueError as err:  # e.g. a pattern that takes in the LM head
            raise CheckpointError(f"the checkpoint's LoRA settings no longer load: {err}") from None
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # shapes that differ: another model than the one it trained
        why = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err))
        raise CheckpointError(f"the checkpoint does not fit the base model {record['base']} ({why}); give the "
                              f"model it trained with --base") from None  # fmt: skip
    own = model.state_dict()
    if unexpected:
        raise CheckpointError(f"the checkpoint does not fit the base model {record['base']}: {unexpected[0]} unknown")
    # tied weights (the LM head and the embedding) are saved once; a LoRA file checkpoint holds only the adapters
    loaded = {own[k].data_ptr() for k in weights}
    adapters_only = peft is not None and all(is_adapter(k) for k in weights)
    lost = [k for k in missing if own[k].data_ptr() not in loaded and (is_adapter(k) or not adapters_only)]
    if lost:
        raise CheckpointError(f"the checkpoint lacks {len(lost)} of the model's weights, e.g. {lost[0]}")
    return model, tokenizer, peft


def without_head_adapters(model: nn.Module, peft: LoRA, weights: dict[str, Tensor]) -> tuple[LoRA, dict[str, Tensor]]:
    """A checkpoint from before LoRA on the LM head was refused (``apply_lora``) names the head in its target modules:
    its head adapters never trained (the loss reads the head's weight, so B stayed 0), and are left out, which
    changes no weight. A non-zero B there is refused."""
    head = next(name for name, module in model.named_modules() if module is model.get_output_embeddings())
    if not isinstance(peft.target_modules, (list, tuple)) or head not in peft.target_modules:
        return peft, weights
    trained = [k for k, v in weights.items() if k.startswith(f"{head}.lora_B.") and bool(v.any())]
    if trained:
        raise CheckpointError(f"the checkpoint's LoRA adapter on the LM head ({trained[0]}) is not zero: sgrpo does "
                              f"not export LM head adapters")  # fmt: skip
    kept = [m for m in peft.target_modules if m != head]
    return LoRA(**(asdict(peft) | {"target_modules": kept})), {
        k: v for k, v in weights.items() if not k.startswith(f"{head}.lora_")}


def export_command(path: Path, out: Path, merged: bool = False, base: str | None = None) -> str:
    """The command line of ``export_checkpoint(path, out, merged, base)``: what to run again after it was cut short."""
    extra = (["--merged"] if merged else []) + ([f"--base={base}"] if base else [])
    return shlex.join(["python", "-m", "sgrpo.export", str(path), str(out), *extra])


def export_checkpoint(path: Path, out: Path, merged: bool = False, base: str | None = None) -> Path:
    """Write ``out`` from the checkpoint at ``path`` (see the module docstring), whole or not at all
    (``staged_export``); refuses a non-empty ``out``."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file: give a folder to write the model into (new or empty)")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty: choose another folder or remove it")
    weights, checkpoint = read_checkpoint(path)
    record = policy_of(path, checkpoint, base)
    if merged and not record.get("peft"):
        raise CheckpointError("--merged applies to LoRA checkpoints; this one holds the whole model")
    model, tokenizer, peft = load_policy(weights, record)
    again = f"run {export_command(path, out, merged, base)} to export again"
    # a new OUT is staged beside it (resolved: "." has no name); an existing empty one written in place
    with staged_export(out.resolve(), again=again, in_place=out.exists()) as staged:
        save_policy(model, tokenizer, staged, peft, str(resolve_model_path(record["base"])), merged)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sgrpo.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a .ckpt file or a sharded checkpoint folder")
    parser.add_argument("out", type=Path, help="the HF folder to write (new or empty)")
    parser.add_argument("--merged", action="store_true", help="LoRA: also write the merged model to OUT/merged")
    parser.add_argument("--base", help="the base model (hub id or folder), for a checkpoint that does not name it")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.merged, args.base)
    except CheckpointError as err:
        exit_with_error(str(err), 2)
    except Exception as err:  # a full or read-only disk: one line, OUT not written (staged_export)
        disk = disk_fault(err)
        if disk is None:
            raise
        what, fix = disk_words(disk)
        again = export_command(args.checkpoint, args.out, args.merged, args.base)
        exit_with_error(f"{what} while exporting to {args.out}: it was not written; {fix}, then run "
                        f"{again}", 1)  # fmt: skip
    print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
    main()
