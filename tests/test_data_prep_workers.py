"""The tokenizer's worker processes end with the process that started them: a `prepare` killed by SIGKILL (the
OOM killer) runs no cleanup, and its spawned workers, re-parented to PID 1, would wait on the pool's pipe
forever, and multiprocessing's resource tracker with them. Real processes: a child starts the pool and
waits; the test kills the child and waits for its workers and tracker to go."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from corpus_helpers import sentencepiece_model

ROOT = Path(__file__).resolve().parents[1]

# A data_prep job in miniature: the pool's workers are up (they tokenized a batch) when it says "ready".
_CHILD = """
import sys, time
import pyarrow as pa
from data_prep.encode import Encoder
with Encoder(sys.argv[1], 3, "uint16", num_proc=2, task_bytes=8) as encoder:
    encoder.run([("train", "input", pa.array(["some text"] * 16))], lambda key, encoded: None)
    print("ready", flush=True)
    time.sleep(3600)
"""


def test_workers_and_resource_tracker_exit_when_their_parent_is_killed(tmp_path):
    model = tmp_path / "tok.model"
    model.write_bytes(sentencepiece_model(64))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(model)], stdout=subprocess.PIPE, text=True, env=env,
                             cwd=ROOT)
    left: list[psutil.Process] = []
    try:
        assert child.stdout.readline().strip() == "ready"
        left = psutil.Process(child.pid).children(recursive=True)  # the 2 workers and the resource tracker
        assert len(left) >= 3, [p.cmdline() for p in left]
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        # A generous bound for a loaded machine, not a measurement: without the fix they never exit.
        gone, alive = psutil.wait_procs(left, timeout=60)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
    finally:
        child.kill()
        for p in left:  # orphans of a failed run: this test started them
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
