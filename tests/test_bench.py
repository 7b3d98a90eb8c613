"""The benchmark harness: workloads, arrivals, stream counting, and one smoke run per
`metrale bench` command at a tiny size. Nothing here asserts a speed: the smoke runs check
that each command measures what it says (every token generated, nothing compiled inside the
timed window, every request answered) and writes a complete record."""

from __future__ import annotations

import asyncio
import json
import math
import pathlib
import shlex
import threading

import numpy as np
import pytest
from aiohttp import web

from metrale_jax.bench import datasets
from metrale_jax.bench.metrics import SLO, RequestRecord, distribution, serving_summary
from metrale_jax.bench.serve import ChunkCounter, LoadSpec, arrival_offsets, check_loopback
from metrale_jax.bench.servers import free_port
from metrale_jax.cli import main
from tests.server_fixtures import running_engine

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---- workloads ---------------------------------------------------------------------------

def test_random_requests_lengths_and_tokens():
    reqs = datasets.random_requests(200, 40, 10, 100, range_ratio=0.5, seed=3)
    ins = [r.input_len for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 60 and len(set(ins)) > 10
    assert all(5 <= r.output_len <= 15 for r in reqs)
    assert all(3 <= t < 100 for r in reqs for t in r.prompt_token_ids)
    again = datasets.random_requests(200, 40, 10, 100, range_ratio=0.5, seed=3)
    assert again == reqs  # seeded: every engine sees the same prompts
    assert len({r.prompt_token_ids for r in reqs}) == len(reqs)


def test_shared_prefix_requests_share_exactly_the_prefix():
    reqs = datasets.shared_prefix_requests(9, 3, 16, 5, 7, 500, seed=1)
    assert all(r.input_len == 21 and r.output_len == 7 for r in reqs)
    for i, r in enumerate(reqs):
        twin = reqs[(i + 3) % 9]
        assert r.prompt_token_ids[:16] == twin.prompt_token_ids[:16]
        assert r.prompt_token_ids[16:] != twin.prompt_token_ids[16:]
    assert reqs[0].prompt_token_ids[:16] != reqs[1].prompt_token_ids[:16]


def test_file_requests_cycle_through_lines(tmp_path):
    class Tok:
        def encode(self, text):
            return [len(w) for w in text.split()]

    path = tmp_path / "prompts.txt"
    path.write_text("to be or\n\nnot to be\n")
    reqs = datasets.file_requests(path, Tok(), 4, n=5)
    assert [r.prompt_token_ids for r in reqs] == [(2, 2, 2), (3, 2, 2)] * 2 + [(2, 2, 2)]
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="no prompts"):
        datasets.file_requests(tmp_path / "empty.txt", Tok(), 4)


def test_bad_workload_parameters_are_refused():
    with pytest.raises(ValueError, match="range_ratio"):
        datasets.random_requests(2, 8, 8, 100, range_ratio=1.5)
    with pytest.raises(ValueError, match="vocab_size"):
        datasets.random_requests(2, 8, 8, 3)


# ---- arrivals, stream counting, summaries ------------------------------------------------

def test_arrivals_poisson_and_gamma():
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    gaps = np.diff(arrival_offsets(20001, 50.0, 1.0, 0))
    assert abs(gaps.mean() - 0.02) < 0.001
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05        # exponential: CV = 1
    bursty = np.diff(arrival_offsets(20001, 50.0, 0.25, 0))
    assert abs(bursty.mean() - 0.02) < 0.002
    assert abs(bursty.std() / bursty.mean() - 2.0) < 0.15    # gamma shape k: CV = 1/sqrt(k)


def test_loopback_only_unless_allowed():
    check_loopback("http://127.0.0.1:8000", False)
    check_loopback("http://localhost:8000", False)
    check_loopback("http://[::1]:8000", False)
    with pytest.raises(ValueError, match="allow-remote"):
        check_loopback("http://10.1.2.3:8000", False)
    check_loopback("http://10.1.2.3:8000", True)
    with pytest.raises(ValueError, match="not an http"):
        LoadSpec(base_url="ftp://127.0.0.1")
    with pytest.raises(ValueError, match="request_rate"):
        LoadSpec(request_rate=0)


def _chunk(text, completion_tokens=None):
    c = {"choices": [{"index": 0, "text": text}]}
    if completion_tokens is not None:
        c["usage"] = {"completion_tokens": completion_tokens}
    return c


def test_multi_token_chunks_are_counted_per_token():
    r = RequestRecord(input_len=4, sent_at=10.0)
    counter = ChunkCounter(r)
    counter.on_chunk(_chunk("a", 1), 10.5)       # first token
    counter.on_chunk(_chunk("bcd", 4), 10.8)     # three tokens in one chunk (MTP)
    counter.on_chunk(_chunk("", 4), 10.9)        # nothing new
    counter.on_chunk(_chunk("e", 5), 11.0)
    counter.on_chunk({"choices": [], "usage": {"completion_tokens": 5}}, 11.0)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itl_s == pytest.approx([0.1, 0.1, 0.1, 0.2])
    assert r.output_tokens == 5


def test_chunks_without_running_usage_count_one_token_each():
    r = RequestRecord(input_len=4, sent_at=0.0)
    counter = ChunkCounter(r)
    for i, t in enumerate((1.0, 1.5, 1.75)):
        counter.on_chunk(_chunk("x"), t)
    assert r.output_tokens == 3 and r.itl_s == pytest.approx([0.5, 0.25])
    counter.on_chunk({"choices": [], "usage": {"completion_tokens": 4}}, 2.0)
    assert r.output_tokens == 4  # the final usage is the truth


def test_serving_summary_goodput_and_percentiles():
    recs = []
    for i in range(10):
        r = RequestRecord(input_len=8, sent_at=0.0, ttft_s=0.01 * (i + 1),
                          itl_s=[0.002] * 3, e2e_s=0.01 * (i + 1) + 0.006, output_tokens=4)
        recs.append(r)
    recs.append(RequestRecord(input_len=8, error="HTTP 500: boom"))
    s = serving_summary(recs, 2.0, SLO(ttft_ms=50.0))
    assert s["completed"] == 10 and s["failed"] == 1 and s["errors"] == {"HTTP 500: boom": 1}
    assert s["goodput_requests_per_s"] == pytest.approx(2.5)   # 5 of 10 meet 50 ms, over 2 s
    assert s["output_tokens_per_s"] == pytest.approx(20.0)
    assert s["ttft"]["median_ms"] == pytest.approx(55.0)
    assert s["tpot"]["mean_ms"] == pytest.approx(2.0)
    assert distribution([])["p99_ms"] is None


# ---- one smoke run per command -----------------------------------------------------------

def _run(args: list[str], tmp_path: pathlib.Path, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["bench", *args, "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["command"] == shlex.join(["metrale", "bench", *args, "--output", str(out)])
    assert record["machine"]["cores"] >= 1 and "jax" in record["machine"]["versions"]
    return record


def test_bench_throughput_smoke(tmp_path):
    rec = _run(["throughput", "--num-prompts", "5", "--concurrency", "2", "--input-len", "12",
                "--output-len", "6", "--range-ratio", "0.3"], tmp_path, "tp")
    res = rec["result"]
    assert res["requests"] == 5 and res["output_tokens"] == rec["workload"]["output_tokens"]
    assert res["compile_s"] > 0 and res["compile_s_in_window"] == 0.0
    assert res["output_tokens_per_s"] > 0


def test_bench_throughput_shared_prefix_smoke(tmp_path):
    rec = _run(["throughput", "--dataset", "shared-prefix", "--num-prompts", "4",
                "--num-prefixes", "2", "--prefix-len", "16", "--input-len", "4",
                "--output-len", "3", "--concurrency", "2"], tmp_path, "tp-prefix")
    assert rec["workload"]["input_tokens"] == 4 * 20 and rec["result"]["requests"] == 4


def test_bench_latency_smoke(tmp_path):
    rec = _run(["latency", "--prompt-lens", "8", "24", "--output-len", "4", "--repeats", "1"],
               tmp_path, "latency")
    assert [r["prompt_len"] for r in rec["rows"]] == [8, 24]
    assert all(r["prefill_ms"] > 0 and r["decode_ms_per_token"] > 0 for r in rec["rows"])


def test_bench_overhead_smoke(tmp_path):
    rec = _run(["overhead", "--batches", "2", "--ticks", "2", "--rounds", "1"], tmp_path, "oh")
    row = rec["rows"][0]
    assert row["batch"] == 2 and row["ratio_pipeline_on"] > 0 and row["ratio_pipeline_off"] > 0


def test_bench_roofline_smoke(tmp_path):
    rec = _run(["roofline", "--batches", "1", "--steps", "2", "--matmul-sizes", "64",
                "--buffer-mb", "4"], tmp_path, "roof")
    assert rec["peaks"]["flops_per_s"] > 0 and rec["peaks"]["bytes_per_s"] > 0
    d = rec["decode"][0]
    assert 0 < d["fraction_of_peak_bandwidth"] and 0 < d["fraction_of_peak_flops"]
    assert d["step_bytes"] > 0 and d["step_flops"] > 0


@pytest.fixture(scope="module")
def live_server():
    """The shared small engine behind a real socket, in a thread of its own, so the
    command under test runs its own event loop as it does for a user."""
    from server.app import create_app

    gen = running_engine()
    engine = next(gen)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(create_app(engine), handler_cancellation=True)
    port = free_port()
    ready = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(60)
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(60)
    gen.close()


def test_bench_serve_smoke(tmp_path, live_server):
    rec = _run(["serve", "--base-url", live_server, "--num-prompts", "6", "--input-len", "8",
                "--output-len", "5", "--max-concurrency", "3", "--request-rate", "1000",
                "--burstiness", "0.5", "--goodput", "ttft:60000", "e2el:60000"],
               tmp_path, "serve")
    res = rec["result"]
    assert res["completed"] == 6 and res["failed"] == 0 and res["not_sent"] == 0
    assert res["output_tokens"] == 30                       # every token counted once
    assert res["goodput_requests_per_s"] == pytest.approx(res["requests_per_s"])
    assert res["ttft"]["p99_ms"] >= res["ttft"]["median_ms"] > 0
    assert res["itl"]["mean_ms"] is not None and res["tpot"]["mean_ms"] is not None
    assert res["server_compiling_variants_at_start"] == 0  # a warmed engine, as /health says


def test_bench_serve_chat_endpoint_smoke(tmp_path, live_server):
    rec = _run(["serve", "--base-url", live_server, "--endpoint", "/v1/chat/completions",
                "--num-prompts", "2", "--input-len", "6", "--output-len", "4"],
               tmp_path, "serve-chat")
    assert rec["result"]["completed"] == 2 and rec["result"]["output_tokens"] == 8


def test_bench_serve_bounded_in_time(tmp_path, live_server):
    # Arrivals 1000 s apart: only the first is sent inside a 5 s window.
    rec = _run(["serve", "--base-url", live_server, "--num-prompts", "3", "--input-len", "6",
                "--output-len", "3", "--request-rate", "0.001", "--max-duration", "5"],
               tmp_path, "serve-bounded")
    assert rec["result"]["not_sent"] == 2 and rec["result"]["completed"] == 1


def test_bench_serve_refuses_remote_by_default(live_server):
    with pytest.raises(ValueError, match="loopback"):
        main(["bench", "serve", "--base-url", "http://192.0.2.1:8000", "--num-prompts", "1"])


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama-tiny")
    text = "\n".join(p.read_text() for p in sorted((ROOT / "metrale_jax").rglob("*.md")))
    text_file = out.parent / "spm-text.txt"
    text_file.write_text(text * 4)
    assert main(["bench", "make-llama", str(out), "--preset", "llama-tiny",
                 "--text", str(text_file)]) == 0
    return out


def test_make_llama_checkpoint(tiny_llama):
    from metrale_jax.bench.checkpoint import count_parameters

    names = {p.name for p in tiny_llama.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer.json"} <= names
    cfg = json.loads((tiny_llama / "config.json").read_text())
    assert cfg["vocab_size"] == 512 and cfg["num_hidden_layers"] == 2
    assert count_parameters(tiny_llama) == 512 * 64 * 2 + 2 * (
        4 * 64 * 64 // 1 - 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64


def test_make_llama_bfloat16_is_the_same_model_rounded(tmp_path, tiny_llama):
    from safetensors.numpy import load_file

    from metrale_jax.bench.compare import gguf_outtype

    out = tmp_path / "llama-tiny-bf16"
    text_file = tiny_llama.parent / "spm-text.txt"
    assert main(["bench", "make-llama", str(out), "--preset", "llama-tiny",
                 "--text", str(text_file), "--dtype", "bfloat16"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg.get("dtype") or cfg.get("torch_dtype")) == "bfloat16"
    import torch
    from safetensors.torch import load_file as load_torch

    f32, bf16 = load_file(tiny_llama / "model.safetensors"), load_torch(out / "model.safetensors")
    assert set(f32) == set(bf16) and all(t.dtype == torch.bfloat16 for t in bf16.values())
    for name, w in f32.items():
        assert np.array_equal(torch.from_numpy(w).to(torch.bfloat16).float().numpy(),
                              bf16[name].float().numpy()), name
    # llama.cpp gets the checkpoint's own dtype, as ours and transformers do.
    assert gguf_outtype(str(tiny_llama)) == "f32" and gguf_outtype(str(out)) == "bf16"


def test_bench_throughput_transformers_peer_smoke(tmp_path, tiny_llama):
    rec = _run(["throughput", "--model", str(tiny_llama), "--engine", "transformers",
                "--num-prompts", "3", "--concurrency", "2", "--input-len", "6",
                "--output-len", "4", "--range-ratio", "0.3"], tmp_path, "tp-hf")
    assert rec["result"]["engine"] == "transformers" and rec["result"]["requests"] == 3


def test_bench_compare_smoke(tmp_path, tiny_llama):
    assert main(["bench", "compare", "--model", str(tiny_llama), "--peers", "transformers",
                 "--concurrency", "1", "2", "--input-len", "6", "--output-len", "4",
                 "--rounds", "2", "--overhead-batches", "1", "--overhead-ticks", "2", "--overhead-rounds", "1",
                 "--roofline-batches", "1", "--name", "cmp",
                 "--output-dir", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "cmp.json").read_text())
    offline = {(r["engine"], r["concurrency"]) for r in rec["offline"]}
    assert offline == {(e, c) for e in ("metrale_jax", "transformers") for c in (1, 2)}
    for r in rec["offline"]:  # the best of two rounds, both recorded
        assert r["output_tokens_per_s"] == max(r["rounds_output_tokens_per_s"])
        assert len(r["rounds_output_tokens_per_s"]) == 2
    assert {(r["engine"], r["concurrency"]) for r in rec["served"]} == {
        ("metrale_jax", 1), ("metrale_jax", 2)}
    assert all(r["failed"] == 0 and r["output_tokens"] == r["completed"] * 4
               for r in rec["served"])
    assert [(r["peer"], r["concurrency"]) for r in rec["offline_ratios"]] == [
        ("transformers", 1), ("transformers", 2)]
    assert rec["engine_overhead"][0]["batch"] == 1 and rec["roofline"]["decode"]
    for png in ("throughput", "latency", "ratios", "roofline"):
        assert (tmp_path / f"cmp-{png}.png").stat().st_size > 1000


def test_remapped_keeps_shapes_and_sharing_but_not_tokens():
    reqs = datasets.shared_prefix_requests(6, 2, 12, 4, 5, 300, seed=2)
    warm = datasets.remapped(reqs, 300, seed=9)
    assert [(r.input_len, r.output_len) for r in warm] == [(r.input_len, r.output_len)
                                                           for r in reqs]
    assert warm[0].prompt_token_ids[:12] == warm[2].prompt_token_ids[:12]
    assert warm[0].prompt_token_ids[:12] != warm[1].prompt_token_ids[:12]
    assert all(w.prompt_token_ids[:12] != r.prompt_token_ids[:12] for w, r in zip(warm, reqs))
    assert all(3 <= t < 300 for r in warm for t in r.prompt_token_ids)


def test_usage_on_the_last_chunk_brings_the_held_back_tokens():
    # llama-server: one chunk per token, usage on the last choice chunk, and tokens whose
    # text ends mid-character held back until then.
    r = RequestRecord(input_len=4, sent_at=0.0)
    counter = ChunkCounter(r)
    counter.on_chunk(_chunk("a"), 1.0)
    counter.on_chunk(_chunk("b"), 2.0)
    counter.on_chunk(_chunk("", 5), 3.0)
    assert r.output_tokens == 5 and r.itl_s == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])


def test_made_llama_never_generates_unstreamable_tokens(tiny_llama):
    from metrale_jax import LLM, SamplingParams
    from metrale_jax.bench.checkpoint import unstreamable_ids

    banned = set(unstreamable_ids(tiny_llama / "tokenizer.model"))
    assert {0, 1, 2} <= banned and len(banned) == 256 + 3
    llm = LLM(str(tiny_llama), max_seq_len=64, max_batch_size=2, max_tokens_per_tick=64,
              warmup=False)
    reqs = datasets.random_requests(2, 8, 24, 512, seed=5)
    outs = llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    llm.engine.close()
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(tokens) == 48 and not banned & set(tokens)
