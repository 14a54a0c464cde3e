"""A real `mlflow server` on loopback for tests, started once per pytest session and shared.

Use the fixture from any test module:

    from mlflow_server import mlflow_server  # noqa: F401  (pytest finds the fixture by name)

    def test_x(mlflow_server):
        client = MlflowClient(mlflow_server.uri)

The server is cached in this module and stopped at the end of the session (its whole process group:
the `mlflow` CLI starts a uvicorn child), so importing the fixture into several modules still starts one
server. `LoopbackProxy` puts a TCP hop in front of it that a test can cut, to see the server go away.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dist_helpers import free_port  # re-exported: the tracking tests take it from here

START_TIMEOUT_S = 180.0
"""Seconds to wait for /health; ~10 s on an idle 2-core box, several times that when it is busy."""


@dataclass
class MlflowServer:
    """A running server: its tracking URI, store and artifact folder, and its process."""

    uri: str
    root: Path
    process: subprocess.Popen
    stopped: bool = field(default=False, init=False)

    @property
    def log_file(self) -> Path:
        """The server's stdout and stderr."""
        return self.root / "server.log"

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll /health until it answers 200; stop the server and raise with its log tail if it does not."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}:\n{_tail(self.log_file)}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server not healthy after {timeout:.0f} s:\n{_tail(self.log_file)}")
            time.sleep(0.25)

    def stop(self) -> None:
        """End the whole process group (the CLI and its uvicorn worker): SIGTERM, then SIGKILL what lingers."""
        if self.stopped:  # pytest's cleanup and the atexit backstop both call this; a pgid may be reused
            return
        self.stopped = True
        pgid = self.process.pid  # start_new_session=True made the server its group's leader
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5
        while _signal_group(pgid, 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)
        self.process.wait()


def _signal_group(pgid: int, sig: int) -> bool:
    """Send sig to a process group; False when no process is left in it."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def mlflow_executable() -> str:
    """The `mlflow` CLI of the interpreter running the tests (the project's .venv)."""
    exe = Path(sys.executable).parent / "mlflow"
    if not exe.exists():
        raise RuntimeError(f"{exe} not found: install the project (scripts/bootstrap.sh) into this interpreter's venv")
    return str(exe)


def launch_mlflow_server(root: Path) -> MlflowServer:
    """Spawn `mlflow server` on a free loopback port (sqlite store and artifacts under root); do not wait."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [
        mlflow_executable(), "server", "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
        "--workers", "1",
    ]
    # Without this the server starts 7 extra huey job consumers that tests never use.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(root / "server.log", "wb") as log:
        # A new session: the server and its uvicorn child form one process group that stop() ends.
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return MlflowServer(uri=f"http://127.0.0.1:{port}", root=root, process=proc)


def start_mlflow_server(root: Path, timeout: float = START_TIMEOUT_S) -> MlflowServer:
    """Launch a server and wait until it is healthy."""
    server = launch_mlflow_server(root)
    server.wait_healthy(timeout)
    return server


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


_shared: MlflowServer | None = None
_shared_error: str | None = None


def shared_mlflow_server(tmp_path_factory: pytest.TempPathFactory, config: pytest.Config,
                         wait: bool = True) -> MlflowServer:
    """The session's one server: launched on first call, stopped when pytest ends (atexit as a backstop).

    wait=False only launches it: a conftest hook may call that early so the ~10 s start-up overlaps
    other tests; the fixture's later call waits for /health.
    """
    global _shared, _shared_error
    if _shared_error is not None:
        # Do not pay the start-up timeout again for every test that wants the server.
        raise RuntimeError(_shared_error)
    if _shared is None or _shared.process.poll() is not None:
        if _shared is not None:  # it died under an earlier test: clear what is left of it, start anew
            _shared.stop()
        _shared = launch_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
        config.add_cleanup(_shared.stop)
        atexit.register(_shared.stop)
    if wait:
        try:
            _shared.wait_healthy()
        except RuntimeError as e:
            _shared_error = str(e)
            raise
    return _shared


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> MlflowServer:
    """A real MLflow tracking server on 127.0.0.1, shared by the whole session."""
    return shared_mlflow_server(tmp_path_factory, pytestconfig)


@pytest.fixture()
def client(mlflow_server):
    """An MlflowClient of the shared server."""
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.uri)


@pytest.fixture()
def experiment(request) -> str:
    """An experiment name of this test alone."""
    return f"{request.node.name}-{time.time_ns()}"


@pytest.fixture(autouse=True)
def no_mlflow_env(monkeypatch):
    """The URI, experiment and retry settings come from what each test passes, never from the caller's shell."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL",
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)


def cfg_for(uri, experiment, **kw):
    """A TrackingConfig for `uri` and `experiment`, without system metrics unless asked."""
    from txl_dist.config import TrackingConfig

    kw.setdefault("system_metrics", False)
    return TrackingConfig(uri=uri, experiment=experiment, **kw)


class LoopbackProxy:
    """Forwards 127.0.0.1:<port> to a target port until cut(): then connections are refused and open ones
    closed, as when a tracking server goes away in the middle of a run. stall() holds every byte in both
    directions (a server that stopped answering but keeps its connections); flow() lets them through again."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.flowing = threading.Event()
        self.flowing.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="loopback-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._cut.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stall(self) -> None:
        self.flowing.clear()

    def flow(self) -> None:
        self.flowing.set()

    def cut(self) -> None:
        """Stop listening and drop every open connection."""
        self.flowing.set()
        self._cut.set()
        self._thread.join()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._sockets.clear()
