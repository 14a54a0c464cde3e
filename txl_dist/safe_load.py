"""Weights-only unpickling of DeepSpeed's checkpoint files: no checkpoint file can run code.

DeepSpeed 0.19.8 reads its own files with `torch.load(..., weights_only=False)` (checkpoint engine, ZeRO
optimizers, universal conversion and loading, zero_to_fp32), and a pickle can call any function it names.
Every one of those calls looks `torch.load` up on the torch module when it runs, so `restricted_torch_loads()`
replaces that attribute for its duration with a load that forces weights_only=True and allows, besides
torch's own weights-only set (tensors, containers, numbers, strings, dtypes), exactly the globals that
the checkpoints of this project contain (ALLOWED_GLOBALS). A file that names any other global is refused
with one line naming the file and the global (UntrustedCheckpointError), before anything in it runs.

Entry points: `restricted_torch_loads()` around engine.load_checkpoint; `python -m txl_dist.safe_load
ds_to_universal ARGS` for DeepSpeed's universal conversion; `fp32_state_dict_from_zero` and
`load_weights_only` for export. deepspeed is imported inside functions only (engine.py and checkpoint.py
are the modules that import it at load time).

The converter ends with the process that started it (`--parent_pid`, what checkpoint.py passes: the rank that
converts), and its worker processes with it, however either ends, SIGKILL and the OOM killer included (Linux:
the kernel's parent-death signal, `end_with_parent`); elsewhere they run to their end as before.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import importlib
import multiprocessing
import os
import pickle
import re
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent(parent: int | None) -> bool:
    """Have the kernel SIGKILL this process when its parent ends, however that ends (Linux: prctl's
    PR_SET_PDEATHSIG); and end it now when its parent is no longer `parent` (the process that started it ended
    before the call, and this one was handed to another). False where the platform has no parent-death signal
    (nothing set: this process outlives its parent, as before).

    The signal comes when the parent's thread that started this process ends: the converter is started by a
    thread that waits for it (subprocess.run), its pool workers by the converter's main thread."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _parent_pid_in(argv: list[str]) -> int | None:
    """--parent_pid's value, read before argparse (which runs after the imports); None without one."""
    for arg, following in zip(argv, [*argv[1:], ""]):
        if arg.startswith("--parent_pid="):
            following = arg.partition("=")[2]
        elif arg != "--parent_pid":
            continue
        return int(following) if following.isdigit() else None
    return None


if __name__ == "__main__" and _parent_pid_in(sys.argv) is not None:
    # The converter, bound to the rank that started it before anything slow (importing torch and DeepSpeed
    # takes seconds): a rank killed meanwhile (the OOM killer, torchrun restarting its workers) takes it along,
    # where it went on converting beside the restarted start's own conversion, with its memory.
    end_with_parent(_parent_pid_in(sys.argv))

import torch  # noqa: E402  (after the converter's binding to its parent)

from .cli_args import ArgumentParser
from .errors import EXIT_REFUSED, Refused, one_line

# The only non-torch globals in the files DeepSpeed 0.19.8 writes for this project (ZeRO 0-3, fp32 and
# bf16, activation checkpointing, CPU optimizer offload, and their universal conversions), all in the ZeRO
# optimizer-state files and the universal zero/optimizer_state.pt. Each is plain data: unpickling one calls
# its class (or __new__) and fills its __dict__ with what the restricted unpickler itself can build
# (tensors, containers, numbers, strings, these classes), never with a function the file chooses.
ALLOWED_GLOBALS = (
    # Static loss scale object (cur_scale=1, dynamic=False) that every ZeRO optimizer saves, bf16/fp32 too.
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    # int Enum of the ZeRO stage saved with the optimizer state; unpickling looks a member up by value.
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    # Dataclass (numel, start) in the ZeRO 1/2 param_slice_mappings.
    "deepspeed.utils.tensor_fragment.fragment_address",
    # fp16's loss scaler, the same kind of object as LossScaler with a few more numbers. Not seen in a file
    # yet (fp16 needs a GPU here); listed by reading its class, so that fp16 checkpoints are not refused.
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
)

_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL (\S+)")
_REASON_IN_MESSAGE = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")
_lock = threading.RLock()
_depth = 0
_original_load = torch.load


class UntrustedCheckpointError(Refused):
    """A checkpoint file that weights-only unpickling with the allowlist refuses; the message is one line
    naming the file and the global it needs (or what else the unpickler rejected)."""


# ----------------------------------------------------------------------------------------------------
# The restricted load


@functools.cache
def allowed_globals() -> tuple[Any, ...]:
    """ALLOWED_GLOBALS resolved to their objects (imports deepspeed on first use)."""
    return tuple(_resolve(name) for name in ALLOWED_GLOBALS)


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def load_weights_only(f: Any, map_location: Any = None, pickle_module: Any = None, **kwargs: Any) -> Any:
    """torch.load with weights_only=True and the allowlist; refuses (one line) a file that needs more.

    Takes torch.load's arguments so that it can stand in for it; `pickle_module` is ignored (a custom
    unpickler is what weights_only replaces) and `weights_only=False` is overridden.
    """
    kwargs.pop("weights_only", None)
    with _only_these_safe_globals(allowed_globals()):
        try:
            return _original_load(f, map_location=map_location, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:  # what torch raises for anything weights_only refuses
            raise UntrustedCheckpointError(_refusal(f, e)) from None


@contextmanager
def _only_these_safe_globals(objects: tuple[Any, ...]) -> Iterator[None]:
    # Exactly our allowlist: globals that other code added process-wide are not trusted here.
    with _lock:
        saved = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(list(objects))
        try:
            yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(saved)


def _refusal(f: Any, error: BaseException) -> str:
    name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", type(f).__name__)
    found = _GLOBAL_IN_MESSAGE.search(str(error))
    if found:
        return _global_refusal(name, _full_name(found.group(1)))
    reason = _REASON_IN_MESSAGE.search(str(error))
    return (f"{name}: refused: weights-only unpickling rejects it "
            f"({reason.group(1).strip() if reason else one_line(error)}); use a checkpoint this project wrote")


def _global_refusal(name: str | os.PathLike, global_name: str) -> str:
    return (f"{name}: refused: unpickling it needs global {global_name}, which no checkpoint of this project "
            "contains (it may run code); use a checkpoint this project wrote")


def _full_name(name: str) -> str:
    # torch's message drops the module of builtins ("open" for builtins.open); put it back.
    return name if "." in name else f"builtins.{name}"


def check_checkpoint_files(folder: str | os.PathLike) -> None:
    """Refuse (one line) the first *.pt file under `folder` (sorted, recursive) whose pickle names a global
    outside the allowlist, or that is not a torch.save file.

    Reads each file's pickle opcodes and unpickles nothing. Run it on every rank before
    engine.load_checkpoint: at ZeRO 1/2 rank r reads only its own optimizer file, so a rank refused inside
    load_checkpoint would leave the others waiting in a collective; this way every rank refuses together.
    """
    allowed = set(ALLOWED_GLOBALS)
    for path in sorted(Path(folder).rglob("*.pt")):
        try:
            named = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except (pickle.UnpicklingError, ValueError, RuntimeError) as e:  # not a torch.save zip, or opcodes
            raise UntrustedCheckpointError(f"{path}: refused: not a torch.save file weights-only unpickling "
                                           f"accepts ({one_line(e)}); use a checkpoint this project wrote") from None
        unknown = sorted(set(named) - allowed)
        if unknown:
            raise UntrustedCheckpointError(_global_refusal(path, unknown[0]))


@contextmanager
def restricted_torch_loads() -> Iterator[None]:
    """Inside: every `torch.load` (DeepSpeed's included) is load_weights_only. Nests; restores on exit.

    Process-wide while active (it replaces module attributes), so loads in other threads are restricted too
    (and run one at a time: the allowlist is torch's process-wide safe-globals list, swapped per load).
    """
    _enter()
    try:
        yield
    finally:
        _exit()


def _enter() -> None:
    global _depth
    with _lock:
        if _depth == 0:
            torch.load = torch.serialization.load = load_weights_only
        _depth += 1


def _exit() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            torch.load = torch.serialization.load = _original_load


def restrict_this_process() -> None:
    """Restrict every later torch.load of this process for good (a conversion worker process)."""
    with _lock:
        if torch.load is not load_weights_only:
            _enter()


# ----------------------------------------------------------------------------------------------------
# Export


def fp32_state_dict_from_zero(tag_dir: str | os.PathLike, *, lazy: bool = False) -> dict[str, Any]:
    """The consolidated fp32 weights of a ZeRO 1-3 tag folder (DeepSpeed's zero_to_fp32), loads restricted.

    lazy: DeepSpeed's lazy form, each value gathered by its .contiguous() (at ZeRO 3 a pseudo tensor over the
    ranks' memory-mapped fp32 partitions; at ZeRO 1/2 a view of the merged weights), so that a caller can
    gather one tensor at a time instead of holding all of them beside the model."""
    from .deepspeed_import import deepspeed  # noqa: F401  (first: no MLflow)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = Path(tag_dir)
    with restricted_torch_loads():  # every file is read here; gathering a lazy value reads none
        return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name, lazy_mode=lazy)


# ----------------------------------------------------------------------------------------------------
# Universal conversion (a subprocess: python -m txl_dist.safe_load ds_to_universal ...)


def restricted_process_pool(*args: Any, **kwargs: Any) -> ProcessPoolExecutor:
    """A ProcessPoolExecutor whose workers restrict their own torch.load, whatever their start method, and end
    with the converter (end_with_parent), however it ends.

    A forked worker inherits the restriction, but a spawned or forkserver one imports torch afresh. A forked
    worker outliving a killed converter (the OOM killer's choice) finished its task and waited for the next
    forever, holding the converter's output pipes (so rank 0 waited for the converter's end forever), its
    scratch folder's lock and its memory. A forkserver worker's parent is the forkserver, which ends when the
    converter does (it reads a pipe only the converter holds open).
    """
    context = kwargs.get("mp_context") or multiprocessing.get_context()
    parent = None if context.get_start_method() == "forkserver" else os.getpid()
    return ProcessPoolExecutor(*args, initializer=_conversion_worker_start, initargs=(parent,), **kwargs)


def _conversion_worker_start(parent: int | None) -> None:
    end_with_parent(parent)
    # One thread: the pool's processes are the parallelism, and a forked worker's first multithreaded kernel
    # (a zeros_like of an optimizer group, with_never_stepped_state) hung in OpenMP's pool of the converter.
    torch.set_num_threads(1)
    _restrict_for_conversion()


def _restrict_for_conversion() -> None:
    """Restrict every later torch.load of this process for good, and give the conversion the Adam state of a
    ZeRO-3 optimizer that never stepped (with_never_stepped_state)."""
    restrict_this_process()
    torch.load = torch.serialization.load = _conversion_load


def _conversion_load(*args: Any, **kwargs: Any) -> Any:
    return with_never_stepped_state(load_weights_only(*args, **kwargs))


def with_never_stepped_state(obj: Any) -> Any:
    """`obj`, a loaded file; a ZeRO-3 optimizer file whose Adam never stepped given the state Adam starts from.

    Every step of a run can be skipped before its first save (fp16 loss-scale overflows: at a scale of 2**32
    the first ~17), and then DeepSpeed 0.19.8's ZeRO-3 optimizer files hold no state at all. Its universal
    conversion reads each group's exp_avg and exp_avg_sq ("KeyError: 0") and its universal load the step of
    group 0. Adam's first step makes zeros and step 0 of a missing state, so the fill loads as a fresh start
    would. Other files, and other optimizers' (no "betas"), come back as they are."""
    optimizer = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    inner = optimizer.get("optimizer_state_dict") if isinstance(optimizer, dict) else None
    if not isinstance(inner, dict) or "fp32_flat_groups" not in optimizer or inner.get("state") is None:
        return obj
    groups = inner.get("param_groups") or [{}]
    if "betas" not in groups[0]:
        return obj
    for index, fp32 in enumerate(optimizer["fp32_flat_groups"]):
        if index not in inner["state"]:
            inner["state"][index] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(fp32),
                                     "exp_avg_sq": torch.zeros_like(fp32)}
    return obj


def ds_to_universal(args: list[str]) -> None:
    """DeepSpeed's ds_to_universal with `args` (its command line), every load restricted, workers included.

    Its worker pools (a ProcessPoolExecutor when a worker count is > 1) start processes with the platform's
    default method (fork on Linux up to Python 3.13, forkserver from 3.14), so they get restricted_process_pool.
    """
    from .deepspeed_import import deepspeed  # noqa: F401  (first: no MLflow)
    from deepspeed.checkpoint import ds_to_universal as conversion

    conversion.ProcessPoolExecutor = restricted_process_pool  # for good: this process is the conversion's
    torch.save = _saving_views_compactly(torch.save)  # for good too
    saved_argv = sys.argv
    sys.argv = ["ds_to_universal", *args]
    try:
        parsed = conversion.parse_arguments()
    finally:
        sys.argv = saved_argv
    _restrict_for_conversion()  # for good: this process is the conversion's
    conversion.main(parsed)


def _saving_views_compactly(save: Any) -> Any:
    """torch.save that writes a tensor value of a saved dict that views a larger storage as a copy of its own
    elements (the same values; torch.save of a view writes its whole storage).

    DeepSpeed 0.19.8's conversion writes the fp32 weights of parameters without optimizer fragments (a tied
    alias such as crit.out_layers.0.weight, the embedding's weight under another name) from the tag's model
    states, whose tensors in an fp32 ZeRO 1/2 run are views of one flat buffer of the whole model: every such
    file held all the model's weights (7 aliases in configs/large.json, each its 1.1 GB of fp32 weights)."""
    @functools.wraps(save)
    def compact(obj: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(obj, dict):
            obj = {k: v.clone() if torch.is_tensor(v) and v.untyped_storage().nbytes() > v.nbytes else v
                   for k, v in obj.items()}
        return save(obj, *args, **kwargs)

    return compact


_EXAMPLE = ("example (what txl_dist/checkpoint.py runs for an elastic resume):\n"
            "  python -m txl_dist.safe_load ds_to_universal --input_folder runs/tiny/checkpoints/step_00000100 \\\n"
            "      --output_folder runs/tiny/checkpoints/step_00000100_universal\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line: DeepSpeed's own tools, with this module's restriction on every load."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = ArgumentParser(
        prog="python -m txl_dist.safe_load", epilog=_EXAMPLE, formatter_class=raw,
        description="DeepSpeed's checkpoint tools with every torch.load restricted to weights-only unpickling.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="the tool")
    what = "DeepSpeed's ds_to_universal: a ZeRO checkpoint -> its universal form (for another world size)"
    p = sub.add_parser("ds_to_universal", help=what, epilog=_EXAMPLE, formatter_class=raw,
                       description=what + "; any other option of deepspeed.checkpoint.ds_to_universal passes through.")
    p.add_argument("--input_folder", required=True, metavar="TAG_DIR",
                   help="the checkpoint tag, e.g. runs/tiny/checkpoints/step_00000100")
    p.add_argument("--output_folder", required=True, metavar="OUT_DIR",
                   help="the universal copy to write, e.g. runs/tiny/checkpoints/step_00000100_universal")
    p.add_argument("--parent_pid", type=int, metavar="PID",
                   help="end (SIGKILL, workers included) when this process's parent ends, which must be PID "
                        "(Linux; what txl_dist/checkpoint.py passes: the rank that converts)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; a refused file is one line on stderr and exit status 2 (as is a bad command line)."""
    args, rest = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        ds_to_universal(["--input_folder", args.input_folder, "--output_folder", args.output_folder, *rest])
    except UntrustedCheckpointError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
