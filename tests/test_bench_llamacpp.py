"""The llama.cpp peer without llama.cpp: CI neither has nor builds it, so these tests cover
what runs without it. Finding the peer (and saying how to make it when it is missing), the
converter's command, environment, output path and reuse, the llama-server command line and
start-up failure, and the continuous batcher driven by a fake engine."""

from __future__ import annotations

import os
import pathlib
import sys
import textwrap

import pytest

from metrale_jax.bench.datasets import BenchRequest
from metrale_jax.bench.peers import llamacpp as L


@pytest.fixture(autouse=True)
def _no_peer_env(monkeypatch):
    """Each test starts as CI does: no peer variables, no llama-server on PATH."""
    monkeypatch.delenv(L.ENV_SOURCE, raising=False)
    monkeypatch.delenv(L.ENV_SERVER, raising=False)


def _executable(path: pathlib.Path, body: str) -> pathlib.Path:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def _touch(path: pathlib.Path, mtime: float) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    os.utime(path, (mtime, mtime))
    return path


def _checkpoint(root: pathlib.Path, mtime: float = 1_000_000.0) -> pathlib.Path:
    ckpt = root / "ckpt"
    for name in ("config.json", "model.safetensors", "tokenizer.model"):
        _touch(ckpt / name, mtime)
    return ckpt


# --- finding the sources --------------------------------------------------------------

def test_source_unset_says_how_to_get_it():
    with pytest.raises(L.PeerNotFoundError) as e:
        L.find_llama_cpp_source()
    msg = str(e.value)
    assert L.ENV_SOURCE in msg
    assert "pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36" in msg


def test_source_bad_path_names_it_and_says_how_to_get_it(tmp_path):
    with pytest.raises(L.PeerNotFoundError) as e:
        L.find_llama_cpp_source(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(e.value)
    assert "pip download" in str(e.value)


def test_source_found_from_path_env_or_package_root(tmp_path, monkeypatch):
    src = tmp_path / "pkg" / "vendor" / "llama.cpp"
    _touch(src / L.CONVERTER, 1.0)
    assert L.find_llama_cpp_source(src) == src.resolve()
    # The llama-cpp-python root works too: its vendored llama.cpp is taken.
    assert L.find_llama_cpp_source(tmp_path / "pkg") == src.resolve()
    monkeypatch.setenv(L.ENV_SOURCE, str(src))
    assert L.find_llama_cpp_source() == src.resolve()


# --- finding llama-server -------------------------------------------------------------

def test_server_missing_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(L.PeerNotFoundError) as e:
        L.find_llama_server()
    msg = str(e.value)
    assert L.ENV_SERVER in msg
    assert "cmake --build /work/peers/llama-build --target llama-server" in msg
    assert "-DBUILD_SHARED_LIBS=ON" in msg
    assert "pip download" in msg  # and where the sources to build come from


def test_server_path_must_be_executable(tmp_path):
    plain = _touch(tmp_path / "llama-server", 1.0)
    with pytest.raises(L.PeerNotFoundError, match="not an executable"):
        L.find_llama_server(plain)
    with pytest.raises(L.PeerNotFoundError, match="cmake"):
        L.find_llama_server(tmp_path / "missing")


def test_server_found_from_path_env_or_which(tmp_path, monkeypatch):
    binary = _executable(tmp_path / "llama-server", "")
    assert L.find_llama_server(binary) == binary.resolve()
    monkeypatch.setenv("PATH", str(tmp_path))
    assert L.find_llama_server() == binary.resolve()
    other = _executable(tmp_path / "elsewhere", "")
    monkeypatch.setenv(L.ENV_SERVER, str(other))
    assert L.find_llama_server() == other.resolve()


# --- the bindings ---------------------------------------------------------------------

def test_bindings_missing_say_how_to_install_without_compiling(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(L.PeerNotFoundError) as e:
        L.import_llama_cpp()
    msg = str(e.value)
    assert 'CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"' in msg
    assert "pip install --no-deps" in msg
    assert "ln -sf /work/peers/llama-build/bin/lib*.so*" in msg


# --- conversion -----------------------------------------------------------------------

def test_gguf_goes_beside_the_checkpoint_unless_told(tmp_path):
    ckpt = tmp_path / "llama-50m"
    assert L.gguf_output_path(ckpt) == tmp_path / "llama-50m-f32.gguf"
    assert L.gguf_output_path(ckpt, outtype="f16") == tmp_path / "llama-50m-f16.gguf"
    assert L.gguf_output_path(ckpt, tmp_path / "x.gguf") == tmp_path / "x.gguf"


def test_gguf_is_current_only_when_newer_than_every_input(tmp_path):
    ckpt = _checkpoint(tmp_path, mtime=1000.0)
    gguf = tmp_path / "m.gguf"
    assert not L.gguf_is_current(ckpt, gguf)                   # missing
    _touch(gguf, 2000.0)
    assert L.gguf_is_current(ckpt, gguf)
    _touch(ckpt / "model.safetensors", 3000.0)                 # weights rewritten
    assert not L.gguf_is_current(ckpt, gguf)
    os.utime(gguf, (3000.0, 3000.0))
    assert L.gguf_is_current(ckpt, gguf)
    _touch(ckpt / "tokenizer.model", 4000.0)                   # tokenizer retrained
    assert not L.gguf_is_current(ckpt, gguf)


def test_convert_reuses_a_current_output_without_the_sources(tmp_path):
    ckpt = _checkpoint(tmp_path, mtime=1000.0)
    out = _touch(tmp_path / "ckpt-f32.gguf", 2000.0)
    # A missing source would raise; a current output never gets that far.
    assert L.convert_to_gguf(ckpt, source=tmp_path / "no-sources") == out


def test_converter_command_and_environment(tmp_path):
    cmd = L.converter_command(tmp_path / "src", tmp_path / "ckpt", tmp_path / "o.gguf", "f16")
    assert cmd == [sys.executable, str(tmp_path / "src" / L.CONVERTER), str(tmp_path / "ckpt"),
                   "--outfile", str(tmp_path / "o.gguf"), "--outtype", "f16"]
    env = L.converter_env(tmp_path / "src", {"PYTHONPATH": "/already", "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "src" / "gguf-py"), "/already"]
    assert env["HOME"] == "/h"
    assert L.converter_env(tmp_path / "src", {})["PYTHONPATH"] == str(tmp_path / "src" / "gguf-py")


def _fake_converter(src: pathlib.Path, body: str) -> pathlib.Path:
    src.mkdir(parents=True, exist_ok=True)
    (src / L.CONVERTER).write_text(textwrap.dedent(body))
    return src


def test_convert_runs_the_converter_and_renames_its_output(tmp_path):
    ckpt = _checkpoint(tmp_path)
    _touch(tmp_path / "ckpt-f32.gguf", 1.0)                    # stale: older than the weights
    src = _fake_converter(tmp_path / "src", """
        import os, sys
        args = sys.argv[1:]
        out = args[args.index("--outfile") + 1]
        with open(out, "w") as f:
            f.write(" ".join(args) + "\\n" + os.environ["PYTHONPATH"])
    """)
    out = L.convert_to_gguf(ckpt, source=src)
    assert out == tmp_path / "ckpt-f32.gguf"
    argv, pythonpath = out.read_text().splitlines()
    assert argv.split()[0] == str(ckpt) and argv.endswith("--outtype f32")
    assert pythonpath.split(os.pathsep)[0] == str(src / "gguf-py")
    assert not list(tmp_path.glob("*.partial"))


def test_convert_failure_shows_the_converter_stderr(tmp_path):
    ckpt = _checkpoint(tmp_path)
    src = _fake_converter(tmp_path / "src", """
        import sys
        args = sys.argv[1:]
        open(args[args.index("--outfile") + 1], "w").write("half a file")
        print("KeyError: 'tokenizer.ggml.tokens'", file=sys.stderr)
        sys.exit(2)
    """)
    with pytest.raises(RuntimeError) as e:
        L.convert_to_gguf(ckpt, tmp_path / "out.gguf", source=src)
    assert "exit 2" in str(e.value) and "tokenizer.ggml.tokens" in str(e.value)
    assert not (tmp_path / "out.gguf").exists()
    assert not list(tmp_path.glob("*.partial"))  # nothing a later run could mistake for done


def test_convert_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        L.convert_to_gguf(tmp_path, source=tmp_path)


# --- llama-server ---------------------------------------------------------------------

def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_server_command_line():
    cmd = L.server_command("/bin/llama-server", "/m/model.gguf", host="127.0.0.1", port=8123,
                           parallel=16, ctx_per_slot=384, threads=2)
    assert cmd[0] == "/bin/llama-server"
    assert _flag(cmd, "--model") == "/m/model.gguf"
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "8123"
    assert _flag(cmd, "--parallel") == "16"
    assert _flag(cmd, "--ctx-size") == str(16 * 384)          # shared out among the slots
    assert _flag(cmd, "--threads") == "2" and _flag(cmd, "--threads-batch") == "2"
    assert {"--cont-batching", "--no-webui", "--no-kv-unified"} <= set(cmd)


@pytest.mark.parametrize("bad", [dict(parallel=0), dict(ctx_per_slot=0), dict(threads=0)])
def test_server_command_rejects_nonpositive_sizes(bad):
    args = dict(host="127.0.0.1", port=1, parallel=1, ctx_per_slot=1, threads=1) | bad
    with pytest.raises(ValueError):
        L.server_command("llama-server", "m.gguf", **args)


def test_llama_server_builds_its_command_and_url(tmp_path):
    binary = _executable(tmp_path / "llama-server", "")
    server = L.LlamaServer(tmp_path / "m.gguf", parallel=4, ctx_per_slot=256, threads=3,
                           binary=str(binary))
    assert 0 < server.port < 65536                           # port=0: one was picked
    assert server.base_url == f"http://127.0.0.1:{server.port}"
    assert server.command == L.server_command(
        binary.resolve(), tmp_path / "m.gguf", host="127.0.0.1", port=server.port,
        parallel=4, ctx_per_slot=256, threads=3)
    assert L.LlamaServer("m.gguf", port=9999, parallel=1, ctx_per_slot=8,
                         binary=str(binary)).base_url == "http://127.0.0.1:9999"


def test_llama_server_that_dies_reports_its_log(tmp_path):
    binary = _executable(tmp_path / "llama-server", """
        import sys
        print("error: failed to load model '/m/model.gguf'")
        sys.exit(1)
    """)
    log = tmp_path / "server.log"
    server = L.LlamaServer("/m/model.gguf", parallel=1, ctx_per_slot=64, threads=1,
                           binary=str(binary), log_path=log)
    with pytest.raises(RuntimeError) as e:
        with server:
            pass
    assert "exited with 1" in str(e.value) and "failed to load model" in str(e.value)
    assert server.proc.poll() == 1


# --- continuous batching with a fake engine -------------------------------------------

def _next_token(history: list[int]) -> int:
    """The fake model: the next token depends on the whole sequence so far."""
    return (sum(t * (i + 1) for i, t in enumerate(history)) + len(history)) % 997


def _reference(r: BenchRequest) -> list[int]:
    history, out = list(r.prompt_token_ids), []
    for _ in range(r.output_len):
        out.append(_next_token(history))
        history.append(out[-1])
    return out


class FakeEngine:
    """A KV cache per seq id that checks what a real one would need: contiguous positions,
    seq ids in range, batches within budget, caches released before reuse."""

    def __init__(self, n_seq: int, budget: int):
        self.n_seq, self.budget = n_seq, budget
        self.kv: dict[int, list[int]] = {}
        self.steps: list[dict[int, int]] = []       # per step: tokens fed per seq id
        self.released: list[int] = []

    def decode(self, tokens, positions, seq_ids, wants_logits):
        assert 0 < len(tokens) <= self.budget
        assert list(seq_ids) == sorted(seq_ids), "grouped by ascending seq id"
        fed: dict[int, int] = {}
        out = []
        for tok, pos, sid, want in zip(tokens, positions, seq_ids, wants_logits, strict=True):
            assert 0 <= sid < self.n_seq
            cache = self.kv.setdefault(sid, [])
            assert pos == len(cache), "positions must continue the sequence's cache"
            cache.append(tok)
            fed[sid] = fed.get(sid, 0) + 1
            if want:
                out.append(_next_token(cache))
        assert len(self.kv) <= self.n_seq
        self.steps.append(fed)
        return out

    def release(self, seq_id):
        del self.kv[seq_id]
        self.released.append(seq_id)


def _requests(spec: list[tuple[int, int]], seed: int = 0) -> list[BenchRequest]:
    return [BenchRequest(tuple((seed + 7 * i + 3 * j) % 500 + 3 for j in range(n_in)), n_out)
            for i, (n_in, n_out) in enumerate(spec)]


@pytest.mark.parametrize("concurrency, budget", [(1, 8), (3, 8), (4, 64), (8, 8)])
def test_batcher_matches_sequential_greedy(concurrency, budget):
    reqs = _requests([(5, 3), (1, 1), (12, 4), (3, 9), (9, 2), (2, 6), (7, 1)])
    engine = FakeEngine(concurrency, budget)
    finished = []
    out = L.greedy_continuous(engine, reqs, concurrency, batch_tokens=budget,
                              on_finish=finished.append)
    assert out == [_reference(r) for r in reqs]
    assert sorted(finished) == list(range(len(reqs)))
    assert len(engine.released) == len(reqs) and not engine.kv


def test_batcher_refills_a_slot_as_soon_as_it_frees():
    # A runs 10 tokens while B, C and D (2 tokens each) take turns in the other slot: with
    # continuous batching the whole run takes A's 10 steps, not 10 + 2 as in waves.
    reqs = _requests([(1, 10), (1, 2), (1, 2), (1, 2)])
    engine = FakeEngine(2, 16)
    L.greedy_continuous(engine, reqs, 2, batch_tokens=16)
    assert len(engine.steps) == 10
    assert engine.released == [1, 1, 1, 0]                    # B, C, D all used seq id 1


def test_batcher_decodes_before_prefilling():
    # A long prompt arriving mid-run is chunked into what the budget leaves after every
    # decoding sequence has had its token.
    reqs = _requests([(2, 6), (1, 1), (20, 2)])
    engine = FakeEngine(2, 4)
    out = L.greedy_continuous(engine, reqs, 2, batch_tokens=4)
    assert out == [_reference(r) for r in reqs]
    decoding_a = [s for s in engine.steps if s.get(0) == 1 and 1 in s]
    assert decoding_a and all(s[1] <= 3 for s in decoding_a)


def test_batcher_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="concurrency"):
        L.greedy_continuous(FakeEngine(1, 8), _requests([(2, 2)]), 0)
    with pytest.raises(ValueError, match="batch_tokens"):
        L.greedy_continuous(FakeEngine(8, 4), _requests([(2, 2)]), 8, batch_tokens=4)
    with pytest.raises(ValueError, match="output_len 0"):
        L.greedy_continuous(FakeEngine(1, 8), [BenchRequest((5,), 0)], 1)


def test_context_holds_the_longest_request_per_sequence():
    reqs = _requests([(128, 128), (100, 300)])
    assert L.context_tokens(reqs, 4) == (512, 2048)
    assert L.context_tokens(_requests([(128, 128)]), 64) == (256, 256 * 64)
