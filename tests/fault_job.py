"""launch/train.py with a fault injected into this process, for the fault tests (tests/test_faults.py).

    python tests/fault_job.py --fault KIND:RANK:STEP [--fault ...] -- <launch/train.py arguments>
    python tests/fault_job.py --entry eval --fault KIND:RANK:STEP -- <launch/eval.py arguments>
    python tests/fault_job.py --entry export --fault KIND:0:0 -- <launch/export.py arguments>

KIND (the fault happens on rank RANK only):
  kill-in-save   SIGKILL itself while writing its DeepSpeed file of the checkpoint of step STEP
  enospc-in-save its DeepSpeed file of the checkpoint of step STEP fails with ENOSPC (a full disk)
  enospc-in-script-copy  rank 0 (ZeRO 1-3): DeepSpeed's copy of zero_to_fp32.py into the checkpoint folder, in the
                 save of step STEP, fails with ENOSPC after writing part of the file
  fail-in-save   DeepSpeed's save of step STEP raises a RuntimeError on it between its two barriers, not in a write
                 (out of memory gathering its state): the other ranks go on to DeepSpeed's last barrier; prints
                 `fail-in-save at <time.time()>`
  fail-before-join  its start-up fails (a RuntimeError: a device that failed) just before it joins the others at
                 the rendezvous store, where they wait for it; prints `fail-before-join at <time.time()>` (STEP: 0)
  slow-save      each of its DeepSpeed files of the checkpoint of step STEP takes SLOW_SAVE_S longer (slow storage)
  kill-before-latest  rank 0: SIGKILL itself as soon as its save of step STEP has renamed the staging folder to
                 the tag, before it writes `latest` and removes tags past checkpoint.keep
  hang-in-save   its first DeepSpeed file of the checkpoint of step STEP is never written (a file system that
                 stopped answering: the process lives on and beats)
  hang-in-verify resuming from the checkpoint of step STEP, its share of the checksums never returns (a file system
                 that stopped answering during start-up)
  hang-in-load   resuming from the checkpoint of step STEP, DeepSpeed's read of its optimizer file never returns
                 (at the world size it was saved at), or of its first file of the tag's universal copy (elastic)
  refuse-load    reading its rank file of the checkpoint of step STEP is refused (the file vanished after start-up)
  fail-in-load   DeepSpeed's load of the checkpoint of step STEP fails on it (a file gone after start-up verified
                 it) while the other ranks go on into the load's collectives; prints `fail-in-load at <time.time()>`
  hang-in-forward  the forward of the last micro batch of step STEP never returns (a deadlock in the compute: the
                 process lives on and beats)
  kill-at-step   SIGKILL itself in the middle of step STEP (after the first micro batch's forward)
  stop-at-step   SIGSTOP itself at the start of step STEP (a hung rank)
  hang-at-step   its read of the first micro batch of step STEP never returns (a stuck file system: the process
                 lives on and beats)
  hang-in-eval   in the evaluation after step STEP, its read of the second segment never returns
  kill-in-test   SIGKILL itself in the evaluation of the test split after step STEP (the final test)
  nan-at-step    the loss of stream 0 of its first micro batch is NaN at step STEP
  nan-from-step  every loss on this rank is NaN from step STEP on
  sigterm-at-step  SIGTERM itself at the end of step STEP
  sigterm-in-eval  launch/eval.py: SIGTERM itself as segment STEP (from 1) of its evaluation begins
  sigusr1-in-eval  launch/eval.py: SIGUSR1 itself as segment STEP (from 1) of its evaluation begins
  slow-eval      launch/eval.py: from segment STEP (from 1) of its evaluation on, each segment takes SLOW_EVAL_S
                 longer (an evaluation of hours), printing `slow-eval: segment N` as it begins
  sigterm-in-export  launch/export.py: SIGTERM itself half-way through writing the --out folder's weights
The faults wrap functions of this process only (torch.save, the trainer's step, the model's forward): the
code under test runs unchanged.
"""
from __future__ import annotations

import errno
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SLOW_SAVE_S = 10.0
SLOW_EVAL_S = 20.0


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


KINDS = frozenset(re.findall(r"^  ([a-z0-9]+(?:-[a-z0-9]+)+) ", __doc__, flags=re.MULTILINE))
"""The kinds the docstring lists: a misspelt one must fail its test's job, not leave it without its fault."""


def install(kind: str, rank: int, step: int) -> None:
    if kind not in KINDS:
        raise SystemExit(f"fault_job: unknown fault kind {kind!r}; known: {', '.join(sorted(KINDS))}")
    if rank != _rank():
        return
    import torch

    from txl_dist import trainer

    staging = f".saving-step_{step:08d}"
    if kind in ("sigterm-in-eval", "sigusr1-in-eval", "slow-eval"):
        from txl_dist import evaluate

        real_evaluate = evaluate.Evaluator.evaluate
        sig = signal.SIGUSR1 if kind == "sigusr1-in-eval" else signal.SIGTERM

        def evaluate_and_stop(self, model, split, on_segment=None):
            def next_segment(i):
                if on_segment is not None:
                    on_segment(i)
                if kind == "slow-eval" and i + 1 >= step:
                    print(f"slow-eval: segment {i + 1}", flush=True)
                    time.sleep(SLOW_EVAL_S)
                elif kind != "slow-eval" and i + 1 == step:  # in the segment, as its forward begins
                    os.kill(os.getpid(), sig)  # the handler runs before the next bytecode
            return real_evaluate(self, model, split, on_segment=next_segment)

        evaluate.Evaluator.evaluate = evaluate_and_stop
        return
    if kind == "sigterm-in-export":
        from txl_dist.interop import native

        def half_written(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"half a file")
            os.kill(os.getpid(), signal.SIGTERM)

        native.save_file = half_written
        return
    if kind in ("kill-in-save", "enospc-in-save", "slow-save", "hang-in-save"):
        real_save = torch.save

        def faulty_save(obj, f, *args, **kwargs):
            path = str(f)
            if staging in path and "txl_state" not in path:
                if kind == "slow-save":
                    time.sleep(SLOW_SAVE_S)
                    return real_save(obj, f, *args, **kwargs)
                if kind == "hang-in-save":
                    _hang_writing_a_file()
                if kind == "kill-in-save":
                    Path(path).write_bytes(b"half a file")
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            return real_save(obj, f, *args, **kwargs)

        torch.save = faulty_save
        return

    if kind == "fail-before-join":
        from txl_dist import rendezvous

        def failing_join(*args, **kwargs):
            print(f"fail-before-join at {time.time()}", flush=True)
            raise RuntimeError("fail-before-join: CUDA error: no CUDA-capable device is detected")

        rendezvous.join = failing_join
        return

    if kind == "fail-in-save":
        from txl_dist.deepspeed_import import deepspeed  # noqa: F401  (first: as the product imports it)
        from deepspeed.runtime.engine import DeepSpeedEngine

        real_save_checkpoint = DeepSpeedEngine._save_checkpoint

        def failing_save_checkpoint(self, save_dir, tag, *args, **kwargs):
            if tag == staging:
                print(f"fail-in-save at {time.time()}", flush=True)
                raise RuntimeError("fail-in-save: out of memory gathering this rank's state")
            return real_save_checkpoint(self, save_dir, tag, *args, **kwargs)

        DeepSpeedEngine._save_checkpoint = failing_save_checkpoint
        return

    if kind == "enospc-in-script-copy":
        from txl_dist.deepspeed_import import deepspeed  # noqa: F401  (first: as the product imports it)
        from deepspeed.runtime import engine as ds_engine

        real_copy = ds_engine.copyfile

        def copy_onto_a_full_disk(src, dst, *args, **kwargs):
            if (Path(dst).parent / staging).is_dir():
                Path(dst).write_bytes(Path(src).read_bytes()[:4096])  # what the disk took
                full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                full.filename, full.filename2 = src, dst  # as shutil's copy raises it
                raise full
            return real_copy(src, dst, *args, **kwargs)

        ds_engine.copyfile = copy_onto_a_full_disk
        return

    if kind == "kill-before-latest":
        from txl_dist import checkpoint

        real_move = checkpoint._move_into_place

        def move_then_die(ckpt_dir, staging_dir, tag_dir):
            real_move(ckpt_dir, staging_dir, tag_dir)
            if tag_dir.name == f"step_{step:08d}":
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint._move_into_place = move_then_die
        return

    if kind == "hang-in-verify":
        from txl_dist import checkpoint

        real_verify = checkpoint.verify

        def hanging_verify(tag_dir, **kwargs):
            if Path(tag_dir).name == f"step_{step:08d}":
                _hang_reading_a_file()
            return real_verify(tag_dir, **kwargs)

        checkpoint.verify = hanging_verify
        return

    if kind == "hang-in-load":
        from txl_dist import safe_load

        real_load = safe_load.load_weights_only  # what every torch.load is inside DeepSpeed's load

        def hanging_load(f, *args, **kwargs):
            path = str(f)
            if f"step_{step:08d}" in path and ("optim_states" in path or "_universal" in path):
                _hang_reading_a_file()
            return real_load(f, *args, **kwargs)

        safe_load.load_weights_only = hanging_load
        return

    if kind == "fail-in-load":
        from deepspeed.runtime.engine import DeepSpeedEngine

        real_load = DeepSpeedEngine.load_checkpoint

        def failing_load(self, load_dir, tag=None, **kwargs):
            if str(tag).startswith(f"step_{step:08d}"):
                print(f"fail-in-load at {time.time()}", flush=True)
                raise FileNotFoundError(errno.ENOENT, "file gone in fail-in-load", f"{load_dir}/{tag}/zero")
            return real_load(self, load_dir, tag=tag, **kwargs)

        DeepSpeedEngine.load_checkpoint = failing_load
        return

    if kind == "refuse-load":
        from txl_dist import checkpoint

        def refused(tag_dir, ranks):
            raise checkpoint.CheckpointError(f"{checkpoint.rank_file(Path(tag_dir), rank)}: missing (refuse-load)")

        checkpoint.load_rank_states = refused
        return

    if kind == "kill-in-test":
        real_run_eval = trainer.Trainer.run_eval

        def run_eval_that_dies(self, split, prefix):
            if self.step == step and prefix == "test":
                os.kill(os.getpid(), signal.SIGKILL)
            return real_run_eval(self, split, prefix)

        trainer.Trainer.run_eval = run_eval_that_dies
        return
    if kind == "hang-in-eval":
        real_run_eval = trainer.Trainer.run_eval

        def run_eval_that_hangs(self, split, prefix):
            if self.step == step:
                _hang_in_second_segment(self.evaluator)
            return real_run_eval(self, split, prefix)

        trainer.Trainer.run_eval = run_eval_that_hangs
        return

    real_step = trainer.Trainer.train_step

    def faulty_step(self):
        current = self.step + 1
        if kind == "stop-at-step" and current == step:
            os.kill(os.getpid(), signal.SIGSTOP)
        if kind == "hang-at-step" and current == step:
            self._batches = _hanging(self._batches)
        if kind == "kill-at-step" and current == step:
            _kill_after_first_forward(self)
        if kind == "hang-in-forward" and current == step:
            _hang_in_last_forward(self)
        if kind in ("nan-at-step", "nan-from-step") and (current == step or (kind == "nan-from-step" and current > step)):
            _poison_next_forward(self, whole=kind == "nan-from-step")
        stats = real_step(self)
        if kind == "sigterm-at-step" and current == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return stats

    trainer.Trainer.train_step = faulty_step


def _hang_reading_a_batch() -> None:
    threading.Event().wait()


def _hang_reading_a_file() -> None:
    threading.Event().wait()


def _hang_writing_a_file() -> None:
    threading.Event().wait()


def _hanging(batches):
    _hang_reading_a_batch()
    yield from batches


def _hang_in_second_segment(evaluator) -> None:
    real_evaluate = evaluator.evaluate

    def evaluate(model, split, on_segment=None):
        def next_segment(i):
            if i == 1:
                _hang_reading_a_batch()
            on_segment(i)
        return real_evaluate(model, split, on_segment=next_segment)

    evaluator.evaluate = evaluate


def _hang_in_last_forward(t) -> None:
    forwards = []

    def hook(module, args):
        forwards.append(1)
        if len(forwards) == t.loader.accumulation_steps:
            _deadlocked_in_the_forward()

    t.engine.module.register_forward_pre_hook(hook)


def _deadlocked_in_the_forward() -> None:
    threading.Event().wait()


def _kill_after_first_forward(t) -> None:
    def hook(module, args, output):
        os.kill(os.getpid(), signal.SIGKILL)

    t.engine.module.register_forward_hook(hook)


def _poison_next_forward(t, whole: bool) -> None:
    import torch

    handle = None

    def hook(module, args, output):
        # A product, not an assignment: the NaN reaches the gradients too, as a real overflow's would.
        poison = torch.ones_like(output.nll)
        if whole:
            poison[:] = float("nan")
        else:
            poison[0, 0] = float("nan")
        handle.remove()
        return output._replace(nll=output.nll * poison)

    handle = t.engine.module.register_forward_hook(hook)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    # deepspeed's launcher puts --local_rank=N first: it is the entry point's (which reads it from LOCAL_RANK)
    options = [a for a in argv[:split] if not a.startswith("--local_rank")]
    entry_args = argv[split + 1:]
    entry = "train"
    if "eval" in options or "export" in options:  # as launch/eval.py and launch/export.py start
        from txl_dist.stop_request import catch_sigterm_early

        catch_sigterm_early()
    for i in range(0, len(options), 2):
        if options[i] == "--entry":
            entry = options[i + 1]
            continue
        assert options[i] == "--fault", options
        kind, rank, step = options[i + 1].split(":")
        install(kind, int(rank), int(step))
    if entry == "eval":
        from launch.eval import main as eval_main

        return eval_main(entry_args)
    if entry == "export":
        from launch.export import main as export_main

        return export_main(entry_args)
    from launch.train import main as train_main

    return train_main(entry_args)


if __name__ == "__main__":
    from txl_dist.host import quiet_torch_cpp_warnings

    quiet_torch_cpp_warnings()  # as launch/train.py starts (before torch)
    from txl_dist.entry import exit_process  # as launch/train.py ends

    exit_process(main(sys.argv[1:]))
