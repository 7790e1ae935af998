"""Remote measurement: TVM's RPC tracker and servers, and MetaSchedule's RPC runner over them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from tvmfuse.errors import TvmfuseError


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port), or a TvmfuseError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TvmfuseError(f"--rpc {text!r}: expected HOST:PORT of an RPC tracker, e.g. 127.0.0.1:9190")
    return host, int(port)


def tracker_summary(host: str, port: int) -> dict:
    from tvm import rpc  # pylint: disable=import-outside-toplevel

    try:
        return rpc.connect_tracker(host, port).summary()
    except Exception as err:  # pylint: disable=broad-except  (socket and TVM errors alike)
        raise TvmfuseError(f"no RPC tracker answers at {host}:{port} ({type(err).__name__}: {err})") from None


def free_servers(host: str, port: int, key: str) -> int:
    """How many servers registered under `key` are free now."""
    return int(tracker_summary(host, port).get("queue_info", {}).get(key, {}).get("free", 0))


def rpc_runner(address: str, key: str, evaluator_config, timeout_sec: float = 60):
    """MetaSchedule RPCRunner measuring on every free server under `key` (one worker per server)."""
    from tvm.s_tir import meta_schedule as ms  # pylint: disable=import-outside-toplevel

    host, port = parse_address(address)
    servers = free_servers(host, port, key)
    if servers == 0:
        raise TvmfuseError(f"the tracker at {address} has no free server under key {key!r} "
                           f"(see: python -m tvmfuse queue {address})")
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key,
                                 session_priority=1, session_timeout_sec=int(timeout_sec))
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator_config, max_workers=servers)


@dataclass
class Cluster:
    """A tracker and RPC servers started as child process groups, stopped by PID."""

    host: str
    port: int
    key: str
    tracker: subprocess.Popen | None = None
    fork: bool = False
    servers: list[subprocess.Popen] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, n_servers: int, gpus: bool = False, timeout: float = 60, fork: bool = False) -> "Cluster":
        """Tracker + `n_servers` servers. Servers spawn a fresh process per session unless `fork`: a forked
        session cannot initialise CUDA (cudaErrorInitializationError, seen on the H200), so fork is for CPU only."""
        self.fork = fork
        self.tracker = _spawn(["tvm.exec.rpc_tracker", "--host", self.host, "--port", str(self.port),
                               "--port-end", str(self.port + 1)])
        _wait_for_port(self.host, self.port, timeout, self.tracker)
        for i in range(n_servers):
            self.add_server(env={"CUDA_VISIBLE_DEVICES": str(i)} if gpus else None)
        deadline = time.time() + timeout
        while free_servers(self.host, self.port, self.key) < n_servers:
            if time.time() > deadline:
                self.stop()
                raise TvmfuseError(f"only {free_servers(self.host, self.port, self.key)} of {n_servers} RPC "
                                   f"servers registered with the tracker at {self.address} in {timeout:.0f} s")
            time.sleep(0.2)
        return self

    def add_server(self, env: dict | None = None) -> subprocess.Popen:
        port = _free_port(self.host)
        proc = _spawn(["tvm.exec.rpc_server", "--host", self.host, "--port", str(port), "--port-end",
                       str(port + 1), "--tracker", self.address, "--key", self.key]
                      + ([] if self.fork else ["--no-fork"]), env)
        self.servers.append(proc)
        return proc

    def kill_server(self, index: int) -> None:
        _kill_group(self.servers[index])

    def stop(self) -> None:
        for proc in self.servers + ([self.tracker] if self.tracker else []):
            _kill_group(proc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _spawn(module_args: list[str], env: dict | None = None) -> subprocess.Popen:
    # A session of its own, so the server's popen workers die with it (TVM's popen pool leaves them orphaned when only
    # the server process is killed).
    # stderr goes to an unnamed temporary file: read back when the process dies at start (see _last_error).
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", *module_args], env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    proc.stderr_file = err  # type: ignore[attr-defined]
    return proc


def _last_error(proc: subprocess.Popen) -> str:
    """The last non-empty line the process wrote to stderr ('' if none)."""
    err = getattr(proc, "stderr_file", None)
    if err is None:
        return ""
    err.seek(0)
    lines = [ln.strip() for ln in err.read().decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            why = _last_error(proc)
            raise TvmfuseError(f"the RPC tracker exited at start: {why}" if why else
                               f"the RPC tracker exited at start (port {port} taken?)")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TvmfuseError(f"the RPC tracker did not listen on {host}:{port} within {timeout:.0f} s")


