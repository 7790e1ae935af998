"""Remote measurement on loopback: a tracker and two RPC servers; one dies mid-run, the job finishes."""

import json

import onnx
import pytest

from test_database import two_kernels
from tvmfuse.cli.tune import main
from tvmfuse.errors import TvmfuseError
from tvmfuse.jobs import Job
from tvmfuse.pipeline import run_job
from tvmfuse.cli.serve import queue_main
from tvmfuse.tune.remote import Cluster, _free_port, free_servers, parse_address


@pytest.fixture(scope="module")
def cluster():
    """One tracker and two servers for the module (starting them takes ~20 s); the tune test kills server 0."""
    with Cluster("127.0.0.1", _free_port("127.0.0.1"), "loopback-cpu") as c:
        yield c.start(2, fork=True)  # CPU only: forked sessions are faster (spawn re-imports TVM)


def test_tune_through_rpc_survives_a_dead_server(cluster, tmp_path, llvm, capsys):
    onnx.save(two_kernels(), tmp_path / "two.onnx")  # two kernels: half the tuning of the 4-kernel default block
    assert queue_main([cluster.address]) == 0
    assert "loopback-cpu" in capsys.readouterr().out
    lines = []

    def say(line):
        lines.append(line)
        if "trials" in line and cluster.servers[0].poll() is None:
            cluster.kill_server(0)  # after the first measured batch

    result = run_job(Job("two", str(tmp_path / "two.onnx"), trials=4), llvm, str(tmp_path / "out"),
                     str(tmp_path / "logs"), say=say, rpc=(cluster.address, cluster.key))
    assert result.ok, result.error
    assert cluster.servers[0].poll() is not None and cluster.servers[1].poll() is None
    manifest = json.loads((tmp_path / "out" / "two-llvm" / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "passed"
    assert [k["schedule"] for k in manifest["kernels"]] == ["tuned", "tuned"]  # the tasks after the kill too
    assert sum("4/4 trials" in line for line in lines) == 2


def test_rpc_errors_are_one_line(tmp_path, capsys, monkeypatch):
    import functools

    from tvm.rpc import base

    # TVM retries a refused connection for 60 s; 1 s gives the same error
    monkeypatch.setattr(base, "connect_with_retry", functools.partial(base.connect_with_retry, timeout=1,
                                                                      retry_period=0.2))
    port = _free_port("127.0.0.1")
    code = main(["--target", "llvm", "--trials", "4", "--out", str(tmp_path), "--rpc", f"127.0.0.1:{port}",
                 "--rpc-key", "k"])
    assert code == 2 and f"no RPC tracker answers at 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["--target", "llvm", "--rpc", "127.0.0.1:9190"]) == 2
    assert "--rpc needs --rpc-key" in capsys.readouterr().err
    with pytest.raises(TvmfuseError, match="expected HOST:PORT"):
        parse_address("nohost")


def test_no_free_server_under_key(cluster):
    assert free_servers(cluster.host, cluster.port, "other-key") == 0


def test_tracker_that_dies_at_start_says_why():
    import socket

    with socket.socket() as taken:  # bound, not listening: the tracker cannot bind it and exits
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(TvmfuseError, match=r"the RPC tracker exited at start: \S"):
            Cluster("127.0.0.1", port, "k").start(0, timeout=30)
