"""One tp=2 engine over two processes (jax.distributed on loopback, gloo CPU collectives,
one CPU device each) against one process at tp=1; and the multi-process settings' checks.

The engine runs are subprocesses of tests/multihost_worker.py: process 0 takes its
settings from the flags, process 1 from the environment, the reference runs alone. The
device count is set per process, before jax is imported (this pytest worker has already
imported it with its own).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from metrale_jax.parallel import distributed as multi_process
from metrale_jax.parallel.config import ParallelConfig, ParallelConfigError

ROOT = pathlib.Path(__file__).parent.parent
TIMEOUT_S = 300
# As tests/test_tensor_parallel.py: the shards' partial sums are added in another order.
LOGPROB_TOL = 1e-4
TWO = dict(num_processes=2, coordinator_address="127.0.0.1:1234")


# -- the settings (no jax) ---------------------------------------------------------------------

def test_multi_process_settings_are_checked():
    assert not ParallelConfig().multi_process
    assert ParallelConfig(2, process_id=1, **TWO).multi_process
    with pytest.raises(ParallelConfigError, match="process_id: must be an integer in 0..1"):
        ParallelConfig(2, process_id=2, **TWO)
    with pytest.raises(ParallelConfigError, match="process_id"):
        ParallelConfig(process_id=1)  # one process: only process 0
    with pytest.raises(ParallelConfigError, match="num_processes: must be a positive"):
        ParallelConfig(num_processes=0)
    with pytest.raises(ParallelConfigError, match="coordinator_address: .* 'host:port'"):
        ParallelConfig(2, num_processes=2)
    with pytest.raises(ParallelConfigError, match="coordinator_address"):
        ParallelConfig(2, num_processes=2, coordinator_address="localhost")
    with pytest.raises(ParallelConfigError, match="data_parallel_size: 2 is not supported"):
        ParallelConfig(2, 2, **TWO)
    with pytest.raises(ParallelConfigError, match="must be a multiple of num_processes=2"):
        ParallelConfig(1, **TWO)


def test_settings_come_from_the_environment_and_the_flags():
    import argparse

    env = {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
           "JAX_COORDINATOR_ADDRESS": "10.0.0.1:8476", "UNRELATED": "x"}
    assert multi_process.settings_from_env(env) == {
        "num_processes": 2, "process_id": 1, "coordinator_address": "10.0.0.1:8476"}
    assert multi_process.settings_from_env({}) == {}
    with pytest.raises(ParallelConfigError, match="JAX_PROCESS_ID: must be an integer"):
        multi_process.settings_from_env({"JAX_PROCESS_ID": "one"})
    parser = argparse.ArgumentParser()
    multi_process.add_arguments(parser)
    args = parser.parse_args(["--num-processes", "2", "--process-id", "0",
                              "--coordinator-address", "127.0.0.1:9"])
    assert multi_process.from_arguments(args) == {
        "num_processes": 2, "process_id": 0, "coordinator_address": "127.0.0.1:9"}
    config = multi_process.with_distributed(ParallelConfig(2), multi_process.from_arguments(args))
    assert (config.tp, config.num_processes, config.process_id) == (2, 2, 0)
    assert multi_process.with_distributed(ParallelConfig(2), None) == ParallelConfig(2)
    with pytest.raises(ParallelConfigError, match=r"unknown settings \['rank'\]"):
        multi_process.with_distributed(ParallelConfig(2), {"rank": 1})


def test_what_would_diverge_is_refused():
    two = ParallelConfig(2, process_id=1, **TWO)
    with pytest.raises(ParallelConfigError, match="offline and lockstep only"):
        multi_process.refuse_serving(two)
    multi_process.refuse_serving(ParallelConfig(2))  # one process serves
    with pytest.raises(ParallelConfigError, match="gate 'auto' measures wall-clock"):
        multi_process.check_engine(two, mtp_gate="auto")
    multi_process.check_engine(two, mtp_gate="on")
    with pytest.raises(ParallelConfigError, match="needs 1 device.* this process has 4 of 4"):
        multi_process.check_devices(two, global_count=4, local_count=4)
    multi_process.check_devices(two, global_count=2, local_count=1)


def test_serve_refuses_more_than_one_process():
    from metrale_jax.cli import build_parser
    from server.serve import engine_kwargs

    args = build_parser().parse_args(["serve", "-tp", "2", "--num-processes", "2",
                                      "--process-id", "1", "--coordinator-address",
                                      "127.0.0.1:9"])
    with pytest.raises(SystemExit, match="offline and lockstep only"):
        engine_kwargs(args)


# -- two processes, one engine -----------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in multi_process.ENV_VARS.values()}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               **extra)
    return env


def _run_all(commands: dict[str, tuple[list[str], dict]], tmp: pathlib.Path) -> dict:
    """Start every command at once; wait for all within TIMEOUT_S, killing the rest when
    one fails or time runs out (a lone process of a pair would wait for its peer)."""
    procs = {}
    for name, (argv, env) in commands.items():
        log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed below
        procs[name] = (subprocess.Popen([sys.executable, "-m", "tests.multihost_worker",
                                         str(tmp / f"{name}.json"), *argv], cwd=ROOT,
                                        env=env, stdout=log, stderr=subprocess.STDOUT), log)
    deadline = time.monotonic() + TIMEOUT_S
    failed = None
    try:
        while any(p.poll() is None for p, _ in procs.values()):
            failed = next((n for n, (p, _) in procs.items() if p.poll()), None)
            if failed or time.monotonic() > deadline:
                break
            running = next((p for p, _ in procs.values() if p.poll() is None), None)
            try:  # wake when a process exits, or every half second to check the others
                if running is not None:
                    running.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        failed = failed or next((n for n, (p, _) in procs.items() if p.poll()), None)
    finally:
        for p, log in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
    logs = {n: (tmp / f"{n}.log").read_text()[-3000:] for n in procs}
    if failed or any(p.returncode for p, _ in procs.values()):
        pytest.fail(f"{failed or 'timeout'}: " + "\n".join(
            f"--- {n} (rc {p.returncode}) ---\n{logs[n]}" for n, (p, _) in procs.items()))
    return {n: json.loads((tmp / f"{n}.json").read_text()) for n in procs}


@pytest.fixture(scope="module", params=["llama"])
def runs(request, tmp_path_factory) -> dict:
    """The tiny Llama (`--model hybrid` runs the tiny hybrid the same way, its Mamba2 state
    sharded by head: kept out of the suite for its time on 2 cores)."""
    tmp = tmp_path_factory.mktemp(f"multihost-{request.param}")
    address = f"127.0.0.1:{_free_port()}"
    model = ["--model", request.param]
    return _run_all({
        "p0": ([*model, "--tp", "2", "--num-processes", "2", "--process-id", "0",
                "--coordinator-address", address], _env()),
        "p1": ([*model, "--tp", "2"], _env(JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1",
                                           JAX_COORDINATOR_ADDRESS=address)),
        "single": ([*model, "--tp", "1"], _env()),
    }, tmp)


def _close(a: list, b: list) -> bool:
    """Same token ids at every position, log-probabilities within the tolerance."""
    return len(a) == len(b) and all(
        [t for t, _ in x] == [t for t, _ in y]
        and all(abs(p - q) <= LOGPROB_TOL for (_, p), (_, q) in zip(x, y))
        for x, y in zip(a, b))


def test_two_processes_run_one_engine(runs):
    """The mesh spans both processes (2 devices, 1 local each), and both processes read
    back the very same results: one program, replicated outputs."""
    p0, p1 = runs["p0"], runs["p1"]
    assert (p0["process_id"], p1["process_id"]) == (0, 1)
    assert p0["processes"] == p1["processes"] == 2
    assert len(p0["devices"]) == 2 and p0["devices"] == p1["devices"]
    assert len(p0["local_devices"]) == len(p1["local_devices"]) == 1
    assert p0["local_devices"] != p1["local_devices"]
    for key in ("scored", "outputs", "logprobs", "prompt_logprobs", "spills", "swap_ins",
                "prefix_hit_tokens"):
        assert p0[key] == p1[key], key


def test_two_processes_equal_one(runs):
    """tp=2 over two processes gives tp=1's greedy tokens and log-probabilities on one
    process, through spills to disk and resumes (the swap gather across processes),
    prefix-cache hits and the async pipeline."""
    multi, single = runs["p0"], runs["single"]
    assert single["processes"] == 1
    assert multi["scored"] == single["scored"]
    assert multi["outputs"] == single["outputs"]
    assert _close(multi["logprobs"], single["logprobs"])
    assert _close(multi["prompt_logprobs"], single["prompt_logprobs"])
    assert multi["spills"] > 0 and multi["swap_ins"] > 0
    assert multi["prefix_hit_tokens"] > 0
    for key in ("spills", "swap_ins", "prefix_hit_tokens"):
        assert multi[key] == single[key], key
