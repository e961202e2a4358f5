"""Resuming a checkpoint on another shape: another `world_size`, another ZeRO stage, another engine.

A checkpoint records the shape each training role was written with (`trainer_shapes` in its
`pipeline_state.json`: engine, ranks, ZeRO stage, dtype, LoRA); a checkpoint from before that
record is read from its files (DeepSpeed's `mp_rank_00_model_states.pt` names its DP world size and
config, FSDP2 leaves one RNG file per rank). Before any worker starts, `resume_actions` compares it
with the config and decides, per role:

* **exact**: the same shape; the engine loads its own files.
* **resharded**: FSDP2 to FSDP2 on other ranks (torch.distributed.checkpoint re-splits the shards
  at load time), or DeepSpeed ZeRO-0 in fp32, whose weights and optimizer state are whole in the
  checkpoint.
* **converted**: DeepSpeed ZeRO-1/2 to DeepSpeed ZeRO-1/2 on other ranks or the other stage,
  ZeRO-3 to ZeRO-3 on other ranks, and DeepSpeed ZeRO-1/2 to FSDP2: the checkpoint is converted once, in the driver, to DeepSpeed's
  universal checkpoint (`deepspeed.checkpoint.ds_to_universal`: per parameter, the whole fp32
  master weight, Adam's two moments and the step), kept in the checkpoint folder as `universal/`.
  DeepSpeed loads it with `load_universal_checkpoint`; FSDP2 reads the same files as whole tensors
  and shards them (`set_state_dict` of full state dicts). The LR schedule and the optimizer step
  come from the checkpoint's model-states file.
* **refused**, before any worker starts, naming what differs and what to do: FSDP2 to DeepSpeed,
  ZeRO-1/2 to or from ZeRO-3 (DeepSpeed 0.19's universal loader does not cross that line), ZeRO-3
  to FSDP2, ZeRO-0 to or from another stage, a ZeRO-0 bf16/fp16 checkpoint on other ranks, a ZeRO-0
  checkpoint in another dtype (`dtype: auto` resolves per machine: the refusal names the checkpoint's),
  a LoRA adapter on another engine or stage, a LoRA run resumed without LoRA or the reverse.

What stays exact across a reshape and what does not is in docs/crash_safety.md.
"""
from __future__ import annotations

import contextlib
import glob
import io
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from roll_gspo.lifecycle.checkpoint import COMPLETE_MARKER, CheckpointError, complete_checkpoints, read_state

logger = logging.getLogger("roll_gspo")
SHAPES_KEY = "trainer_shapes"  # pipeline_state.json: {role: TrainerShape as a dict}
UNIVERSAL_DIR = "universal"  # inside a role's checkpoint folder: DeepSpeed's universal checkpoint
DS_TAG = "engine"  # the DeepSpeed checkpoint's tag (its subfolder)
ROLE_SUBDIRS = {"actor_train": "", "critic": "critic"}  # where each role's engine state lies in a checkpoint

# How a worker loads its role's state (ResumeAction.load_mode).
LOAD_NATIVE = "native"  # the engine's own files (exact, or resharded by the engine itself)
LOAD_UNIVERSAL = "universal"  # DeepSpeed's universal checkpoint in <role folder>/universal/


class ResumeShapeError(CheckpointError):
    """The checkpoint cannot be resumed with this config's training shape (raised before workers start)."""


@dataclass(frozen=True)
class TrainerShape:
    engine: str  # "deepspeed" | "fsdp2"
    world_size: Optional[int]  # None: not known (a ZeRO-0 checkpoint from before the record)
    zero_stage: Optional[int]  # DeepSpeed only
    dtype: Optional[str]  # None: not known (a checkpoint from before the record)
    lora: bool = False

    def describe(self) -> str:
        engine = f"DeepSpeed ZeRO-{self.zero_stage}" if self.engine == "deepspeed" else "FSDP2"
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}" if self.world_size else "? ranks"
        extra = [self.dtype] if self.dtype else []
        return f"{engine}, {ranks}" + "".join(f", {e}" for e in extra + (["LoRA"] if self.lora else []))


def role_shape(role) -> TrainerShape:
    """The shape a role's config trains with (a `RoleConfig` of a `deepspeed_train`/`fsdp2_train` role)."""
    name = role.strategy_args.strategy_name
    if name.startswith("fsdp2"):
        return TrainerShape("fsdp2", int(role.world_size), None, role.model_args.dtype, role.model_args.uses_lora())
    zero = (role.strategy_args.strategy_config or {}).get("zero_optimization") or {}
    return TrainerShape("deepspeed", int(role.world_size), int(zero.get("stage", 0) or 0), role.model_args.dtype,
                        role.model_args.uses_lora())


def trainer_roles(cfg) -> Dict[str, Any]:
    """The roles whose engine state a checkpoint holds."""
    return {"actor_train": cfg.actor_train, **({"critic": cfg.critic} if cfg.uses_critic() else {})}


def shapes_record(cfg) -> Dict[str, Dict[str, Any]]:
    """What a checkpoint's driver state records (`SHAPES_KEY`)."""
    return {name: asdict(role_shape(role)) for name, role in trainer_roles(cfg).items()}


def role_folder(folder: str, role: str) -> str:
    return os.path.join(folder, ROLE_SUBDIRS[role]) if ROLE_SUBDIRS[role] else folder


def saved_shape(folder: str, role: str, state: Optional[Dict[str, Any]] = None) -> Optional[TrainerShape]:
    """The shape `role` was saved with: the record in the driver state, else read from the files;
    None when the checkpoint holds no state of that role."""
    state = read_state(folder) if state is None else state
    recorded = (state.get(SHAPES_KEY) or {}).get(role)
    if recorded:
        return TrainerShape(**recorded)
    where = role_folder(folder, role)
    if os.path.isdir(os.path.join(where, DS_TAG)):
        return _deepspeed_files_shape(os.path.join(where, DS_TAG))
    if os.path.isdir(os.path.join(where, "fsdp2")):
        ranks = len(glob.glob(os.path.join(where, "fsdp2_rng_rank*.pt"))) or None
        return TrainerShape("fsdp2", ranks, None, None)
    return None


def _deepspeed_files_shape(engine_dir: str) -> TrainerShape:
    """A DeepSpeed checkpoint's shape from its model-states file (memory-mapped: its weights are not read)."""
    import torch

    states = sorted(glob.glob(os.path.join(engine_dir, "*mp_rank_00_model_states.pt")))
    if not states:
        raise CheckpointError(f"{engine_dir} holds no DeepSpeed model-states file (mp_rank_00_model_states.pt): "
                              f"not a DeepSpeed checkpoint, or an incomplete one")
    meta = torch.load(states[0], map_location="cpu", weights_only=False, mmap=True)
    config = meta.get("ds_config") or {}
    stage = int((config.get("zero_optimization") or {}).get("stage", 0) or 0)
    dtype = "bf16" if (config.get("bf16") or {}).get("enabled") else "fp16" if (config.get("fp16") or {}).get(
        "enabled") else "fp32"
    lora = bool(meta.get("frozen_param_shapes")) and not meta.get("frozen_param_fragments")
    return TrainerShape("deepspeed", meta.get("dp_world_size"), stage, dtype, lora)


@dataclass(frozen=True)
class ResumeAction:
    """What a resume does with one role's saved state."""
    role: str
    kind: str  # "exact" | "resharded" | "converted" | "refused"
    saved: TrainerShape
    wanted: TrainerShape
    how: str  # what is done, or why it is refused and what to do instead
    load_mode: str = LOAD_NATIVE

    def line(self) -> str:
        if self.kind == "exact":
            return f"{self.role}: exact ({self.saved.describe()})"
        return f"{self.role}: {self.kind}, {self.saved.describe()} -> {self.wanted.describe()}: {self.how}"


def _strategy_name(shape: TrainerShape) -> str:
    return "deepspeed_train" if shape.engine == "deepspeed" else "fsdp2_train"


# Why a config that did not change can change precision: `dtype: auto` is resolved on each machine
# (roll_gspo.config.plan.cpu_precision), so a checkpoint written elsewhere may hold the other one.
AUTO_DTYPE_NOTE = ("model_args.dtype: auto resolves per machine (bf16 on a GPU or where the CPU has bf16 matrix "
                   "instructions, AVX512-BF16 or AMX-BF16; else fp32), so write the checkpoint's dtype to resume it "
                   "on any machine")


def _same_as_saved(role: str, saved: TrainerShape, wanted: TrainerShape) -> str:
    """The keys that resume the checkpoint as written: its precision too when the config's differs,
    since a refusal for the ranks alone would otherwise be followed by one for the dtype."""
    keys = [f"{role}.strategy_args.strategy_name={_strategy_name(saved)}"]
    if saved.engine == "deepspeed":
        keys.append(f"{role}.strategy_args.strategy_config.zero_optimization.stage={saved.zero_stage}")
    if saved.world_size:
        keys.append(f"{role}.world_size={saved.world_size}")
    if _dtype_changes(saved, wanted):
        keys.append(f"{role}.model_args.dtype={saved.dtype}")
    return " ".join(keys)


def _dtype_changes(saved: TrainerShape, wanted: TrainerShape) -> bool:
    return saved.dtype is not None and saved.dtype != wanted.dtype


def decide(role: str, saved: TrainerShape, wanted: TrainerShape) -> ResumeAction:
    """How `role`'s state saved as `saved` resumes under `wanted` (see the module docstring)."""
    def act(kind: str, how: str, mode: str = LOAD_NATIVE) -> ResumeAction:
        return ResumeAction(role, kind, saved, wanted, how, mode)

    def refuse(why: str) -> ResumeAction:
        note = f"; {AUTO_DTYPE_NOTE}" if _dtype_changes(saved, wanted) else ""
        return act("refused", f"{why}; resume with the shape it was written with "
                              f"({_same_as_saved(role, saved, wanted)}){note}")

    same_ranks = saved.world_size is None or saved.world_size == wanted.world_size
    if saved.lora != wanted.lora:
        return refuse("the checkpoint " + ("holds a LoRA adapter and its optimizer state, the config trains every "
                                           "weight" if saved.lora else "trains every weight, the config a LoRA "
                                                                       "adapter") + " (model_args.lora_target)")
    if saved.engine == "fsdp2":
        if wanted.engine == "fsdp2":
            if same_ranks:
                return act("exact", "")
            return act("resharded", "torch.distributed.checkpoint re-splits the weights and Adam's moments over "
                                    "the new ranks at load time; each rank's RNG restarts from the seed (the trainer "
                                    "reseeds it every optimizer step)")
        return refuse("an FSDP2 checkpoint is not converted to DeepSpeed (its weights and Adam's moments would have to "
                      "be written into DeepSpeed's flat partitions); only the weights can carry over: start a new run "
                      "from them (pretrain: the last final_model, or the checkpoint's weights saved with "
                      "torch.distributed.checkpoint.format_utils.dcp_to_torch_save), losing Adam's moments")
    # DeepSpeed saved
    if saved.lora and (wanted.engine != "deepspeed" or wanted.zero_stage != saved.zero_stage):
        return refuse("a LoRA checkpoint (adapter only, frozen weights left out) is not converted between stages or "
                      "engines")
    if wanted.engine == "deepspeed" and wanted.zero_stage == saved.zero_stage and same_ranks:
        if _dtype_changes(saved, wanted):
            if saved.zero_stage == 0:
                return refuse(f"a ZeRO-0 checkpoint in {saved.dtype} does not load in {wanted.dtype}")
            return act("converted", _UNIVERSAL_HOW + " (the fp32 master weights carry over; the new dtype computes)",
                       LOAD_UNIVERSAL)
        return act("exact", "")
    if saved.zero_stage == 0 or (wanted.engine == "deepspeed" and wanted.zero_stage == 0):
        if wanted.engine == "deepspeed" and saved.zero_stage == wanted.zero_stage == 0:
            if _dtype_changes(saved, wanted):  # on other ranks too: no conversion between precisions
                return refuse(f"a ZeRO-0 checkpoint in {saved.dtype} does not load in {wanted.dtype}")
            if saved.dtype in (None, "fp32") and wanted.dtype == "fp32":
                return act("resharded", "a ZeRO-0 fp32 checkpoint holds whole weights and a whole optimizer state, "
                                        "loaded as they are on any number of ranks")
            return refuse(f"a ZeRO-0 {saved.dtype} checkpoint keeps its fp32 master weights partitioned by rank "
                          f"(DeepSpeed's bf16 optimizer), which is not converted here")
        return refuse("ZeRO stage 0 keeps the optimizer state in torch's own format, which DeepSpeed's universal "
                      "checkpoint does not convert; resume with stage 0, or use ZeRO-1/2/3 from the start when a "
                      "run may need to change its shape")
    if wanted.engine == "deepspeed" and (saved.zero_stage == 3) != (wanted.zero_stage == 3):
        return refuse(f"DeepSpeed {deepspeed_version()} loads a universal checkpoint only within ZeRO-1/2 or within "
                      f"ZeRO-3 (ZeRO-3 reads an optimizer-state file that a ZeRO-1/2 conversion does not write, and "
                      f"looks for its model states under another name); resume with stage "
                      f"{'3' if saved.zero_stage == 3 else '1 or 2'}, or under fsdp2_train"
                      + (" (from ZeRO-1/2)" if saved.zero_stage == 3 else ""))
    if saved.zero_stage == 3 and wanted.engine == "fsdp2":
        return refuse("a ZeRO-3 checkpoint is not converted to FSDP2 here (only ZeRO-1/2 ones, through the universal "
                      "checkpoint)")
    if saved.lora:  # same stage (checked above), other ranks
        return refuse("a LoRA checkpoint (adapter only) is not converted to another number of ranks")
    if wanted.engine == "deepspeed":
        return act("converted", _UNIVERSAL_HOW, LOAD_UNIVERSAL)
    return act("converted", _UNIVERSAL_HOW + "; FSDP2 reads its whole tensors and shards them", LOAD_UNIVERSAL)


_UNIVERSAL_HOW = ("DeepSpeed's universal checkpoint (ds_to_universal, once, into the checkpoint's universal/ "
                  "folder): whole fp32 weights, Adam's moments and step per parameter, re-split at load time; LR "
                  "schedule and optimizer step kept")


def deepspeed_version() -> str:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:  # noqa: BLE001  (not installed: the run fails elsewhere, naming it)
        return "?"


def find_resume_folder(output_dir: str, resume_from_checkpoint: Optional[str]) -> Optional[str]:
    """The checkpoint a run would resume from, without touching anything (`--dry-run`): what
    `resolve_resume` picks, None for a fresh start (or when `auto` finds none)."""
    if resume_from_checkpoint is None:
        return None
    if resume_from_checkpoint == "auto":
        existing = complete_checkpoints(output_dir)
        return existing[-1] if existing else None
    if not os.path.exists(os.path.join(resume_from_checkpoint, COMPLETE_MARKER)):
        raise FileNotFoundError(f"resume_from_checkpoint: {resume_from_checkpoint!r} is not a complete checkpoint "
                                f"(no {COMPLETE_MARKER} file)")
    return resume_from_checkpoint


def resume_actions(cfg, folder: str) -> List[ResumeAction]:
    """One action per training role of `cfg` for resuming from `folder`; raises ResumeShapeError
    naming every refused role, what differs and what to do."""
    state = read_state(folder)
    actions, problems = [], []
    for name, role in trainer_roles(cfg).items():
        saved = saved_shape(folder, name, state)
        if saved is None:
            continue  # the role's own load names what is missing (a critic absent from the checkpoint)
        action = decide(name, saved, role_shape(role))
        actions.append(action)
        if action.kind == "refused":
            problems.append(f"resume_from_checkpoint: {folder} cannot resume as configured: {action.line()}")
    if problems:
        raise ResumeShapeError("\n".join(problems))
    return actions


def prepare_resume(folder: str, actions: List[ResumeAction]) -> None:
    """The driver's part of a converted resume, before the workers load: DeepSpeed's universal
    checkpoint of each role that needs one (written once; a later resume reuses it)."""
    for action in actions:
        if action.load_mode == LOAD_UNIVERSAL:
            to_universal(role_folder(folder, action.role))


def to_universal(where: str) -> str:
    """Convert the DeepSpeed checkpoint `<where>/engine` to `<where>/universal/engine` (written into a
    temporary folder, renamed into place); returns `<where>/universal`."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    final = os.path.join(where, UNIVERSAL_DIR)
    if os.path.isdir(os.path.join(final, DS_TAG, "zero")):
        return final
    tmp = os.path.join(where, f".tmp_{UNIVERSAL_DIR}")
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.monotonic()
    args = argparse.Namespace(input_folder=os.path.join(where, DS_TAG), output_folder=os.path.join(tmp, DS_TAG),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    chatter = io.StringIO()  # ds_to_universal prints its progress; the log gets one line
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
        _both_model_state_names(args.output_folder)
        os.rename(tmp, final)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        lines = str(exc).strip().splitlines()
        raise ResumeShapeError(f"converting the DeepSpeed checkpoint {args.input_folder} to a universal checkpoint "
                               f"failed: {type(exc).__name__}: {lines[-1] if lines else ''}") from exc
    logger.info("converted %s to DeepSpeed's universal checkpoint %s in %.1f s", args.input_folder, final,
                time.monotonic() - started)
    return final


def _both_model_state_names(engine_dir: str) -> None:
    """DeepSpeed looks for a universal checkpoint's model-states file under its own stage's name
    (`mp_rank_00_model_states.pt` for ZeRO-1/2, `zero_pp_rank_0_mp_rank_00_model_states.pt` for
    ZeRO-3), and the conversion keeps the source's: both names, one file (a hard link), so a
    ZeRO-2 checkpoint resumes under ZeRO-3 and back."""
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    present = [n for n in names if os.path.exists(os.path.join(engine_dir, n))]
    for name in names:
        if present and name not in present:
            os.link(os.path.join(engine_dir, present[0]), os.path.join(engine_dir, name))


def universal_trainer_state(universal: str) -> Dict[str, Any]:
    """The LR schedule's state and the optimizer step a universal checkpoint carries."""
    import torch

    states = sorted(glob.glob(os.path.join(universal, DS_TAG, "*mp_rank_00_model_states.pt")))
    meta = torch.load(states[0], map_location="cpu", weights_only=False, mmap=True)
    return {"scheduler": meta.get("lr_scheduler"), "global_steps": int(meta.get("global_steps", 0))}


def universal_tensor(universal: str, name: str, kind: str):
    """One parameter's whole `kind` tensor (fp32, exp_avg, exp_avg_sq) or its step, from a universal checkpoint."""
    import torch

    path = os.path.join(universal, DS_TAG, "zero", name, f"{kind}.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"the universal checkpoint {universal} has no {kind} of parameter {name!r}")
    value = torch.load(path, map_location="cpu", weights_only=False)
    return value["param"] if isinstance(value, dict) else value


def describe_resume(cfg, output_dir: str) -> "tuple[List[str], List[str]]":
    """What a resume of `cfg` will do, as `--dry-run` prints it: (lines, problems). Touches nothing."""
    try:
        folder = find_resume_folder(output_dir, cfg.resume_from_checkpoint)
    except FileNotFoundError as exc:
        return [], [str(exc)]
    if folder is None:
        existing = complete_checkpoints(output_dir)
        if cfg.resume_from_checkpoint is None and existing:  # what resolve_resume refuses at the start
            return [], [f"{output_dir} already holds checkpoints ({os.path.basename(existing[-1])} newest): set "
                        f"resume_from_checkpoint=auto to continue, or choose another output_dir"]
        fresh = "no checkpoint yet, a fresh start" if cfg.resume_from_checkpoint else "a fresh start"
        return [f"resume: {fresh}"], []
    try:
        actions = resume_actions(cfg, folder)
    except ResumeShapeError as exc:
        return [f"resume: from {folder}: refused"], str(exc).splitlines()
    except (CheckpointError, OSError, ValueError) as exc:
        return [], [f"resume_from_checkpoint: cannot read {folder}: {exc}"]
    return [f"resume: from {folder}"] + [f"  {action.line()}" for action in actions], []
