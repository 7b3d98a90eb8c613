"""LoRA through the OpenAI-compatible server, as vLLM serves it: `model` naming an adapter,
`/v1/models` listing adapters, `POST /v1/load_lora_adapter` / `unload_lora_adapter`
(answered once the engine thread applied them), `--lora-dir` confinement, metrics.

The engine runs the fake runner (the built-in model's tokenizer, no device step), so these
tests are host-only and exact: an adapter's output is `reference_continuation` under its
weights. The adapter loader is the tests' own and records every directory it is asked to
read, so "refused before anything is read" is checked directly."""

from __future__ import annotations

import os

import openai
import pytest

from metrale_jax.async_engine import AsyncLLM
from server.app import create_app
from server.serve import add_parser, engine_kwargs
from server.state import ServerConfig
from tests.fake_runner import FakeRunner, reference_continuation
from tests.scheduler_harness import fake_loader

ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=64, block_size=4,
              num_kv_blocks=64, enable_swap=False)
PROMPT = "To be, or not to be"


class RecordingLoader:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name, path):
        self.calls.append(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(path)
        return fake_loader(name, path)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for sub in ("sql/1.5", "chat/2.5", "extra/0.5", "extra2/3.5"):
        (root / sub).mkdir(parents=True)
    outside = tmp_path_factory.mktemp("outside")
    (outside / "4.5").mkdir()
    os.symlink(outside / "4.5", root / "escape")
    return root


@pytest.fixture(scope="module")
def loader():
    return RecordingLoader()


@pytest.fixture(scope="module")
def llm(lora_dir, loader):
    runner = FakeRunner(ENGINE["num_kv_blocks"], ENGINE["block_size"],
                        ENGINE["max_batch_size"], max_loras=2)
    engine = AsyncLLM(None, runner=runner, adapter_loader=loader, enable_lora=True,
                      max_loras=2, **ENGINE)
    engine.register_adapter("sql", str(lora_dir / "sql/1.5"))
    engine.register_adapter("chat", str(lora_dir / "chat/2.5"))
    engine.start()
    yield engine
    engine.shutdown(timeout=30)


@pytest.fixture
async def client(llm, lora_dir, aiohttp_client):
    app = create_app(llm, ServerConfig(lora_dir=str(lora_dir)))
    return await aiohttp_client(app, server_kwargs={"handler_cancellation": True})


def oai(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none",
                              max_retries=0)


def expected_text(llm, path: str | None, max_tokens: int = 6, name: str | None = None) -> str:
    """What the fake computes under the adapter at `lora_dir/<name>/<scaling>`."""
    ids = llm.tokenize(PROMPT)
    name = name or (os.path.basename(os.path.dirname(path)) if path else None)
    weights = fake_loader(name, path) if path else None
    return llm.detokenize(reference_continuation(ids, max_tokens, adapter=weights))


async def complete(client_oai, model: str, max_tokens: int = 6) -> str:
    out = await client_oai.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                              temperature=0.0, extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


async def post(client, path, body):
    resp = await client.post(path, json=body)
    return resp.status, await resp.text()


async def test_model_names_an_adapter_through_the_openai_client(client, llm, lora_dir):
    c = oai(client)
    base = llm.limits.model_name
    assert await complete(c, base) == expected_text(llm, None)
    assert await complete(c, "sql") == expected_text(llm, str(lora_dir / "sql/1.5"))
    assert await complete(c, "chat") == expected_text(llm, str(lora_dir / "chat/2.5"))
    chat = await c.chat.completions.create(model="sql", max_tokens=3, temperature=0.0,
                                           messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "sql" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        await complete(c, "no-such-adapter")
    assert await complete(c, "sql") == expected_text(llm, str(lora_dir / "sql/1.5"))
    await c.close()


async def test_models_lists_adapters_with_the_base_as_parent(client, llm, lora_dir):
    models = await oai(client).models.list()
    by_id = {m.id: m for m in models.data}
    base = llm.limits.model_name
    assert by_id["sql"].parent == base and by_id["chat"].parent == base
    assert by_id["sql"].root == str(lora_dir / "sql/1.5")
    assert by_id[base].parent is None


async def test_load_use_replace_and_unload_at_runtime(client, llm, lora_dir):
    c = oai(client)
    status, text = await post(client, "/v1/load_lora_adapter",
                              {"lora_name": "extra", "lora_path": "extra/0.5"})
    assert status == 200 and "extra" in text
    assert await complete(c, "extra") == expected_text(llm, str(lora_dir / "extra/0.5"))
    status, text = await post(client, "/v1/load_lora_adapter",
                              {"lora_name": "extra", "lora_path": "extra/0.5"})
    assert status == 400 and "already been loaded" in text
    status, _ = await post(client, "/v1/load_lora_adapter",
                           {"lora_name": "extra", "lora_path": str(lora_dir / "extra2/3.5"),
                            "load_inplace": True})
    assert status == 200
    assert await complete(c, "extra") == expected_text(llm, str(lora_dir / "extra2/3.5"),
                                                     name="extra")
    status, _ = await post(client, "/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert status == 200
    with pytest.raises(openai.NotFoundError):
        await complete(c, "extra")
    status, text = await post(client, "/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert status == 404 and '"param": "lora_name"' in text
    assert await complete(c, "chat") == expected_text(llm, str(lora_dir / "chat/2.5"))
    await c.close()


@pytest.mark.parametrize("path", ["../outside", "/etc", "escape", "sql/../../x", ""])
async def test_paths_outside_the_lora_dir_are_refused_before_reading(client, loader, path):
    before = list(loader.calls)
    status, text = await post(client, "/v1/load_lora_adapter",
                              {"lora_name": "evil", "lora_path": path})
    assert status == 400 and "lora_path" in text, text
    assert loader.calls == before  # nothing was read


async def test_a_load_that_fails_is_a_400_and_the_server_keeps_serving(client, llm):
    status, text = await post(client, "/v1/load_lora_adapter",
                              {"lora_name": "ghost", "lora_path": "missing"})
    assert status == 400 and "cannot read" in text
    assert await complete(oai(client), "sql")


async def test_runtime_loading_needs_a_lora_dir(llm, aiohttp_client):
    client = await aiohttp_client(create_app(llm, ServerConfig()))
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
        status, text = await post(client, path, body)
        assert status == 400 and "--lora-dir" in text


async def test_metrics_and_snapshot_report_adapters(client):
    assert await complete(oai(client), "sql")
    metrics = await (await client.get("/metrics")).text()
    assert "metrale:lora_requests_info{" in metrics and 'max_lora="2"' in metrics
    assert "metrale:lora_loaded_adapters" in metrics
    snap = (await (await client.get("/v1/admin/snapshot")).json())["snapshot"]
    assert snap["max_loras"] == 2 and "sql" in snap["lora_loaded"]


def test_serve_flags_are_vllms():
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x",
                              '{"name": "b", "path": "/y"}', "--max-loras", "3",
                              "--max-lora-rank", "32", "--lora-dir", "/adapters"])
    assert args.lora_modules == [("a", "/x"), ("b", "/y")] and args.lora_dir == "/adapters"
    kw = engine_kwargs(args)
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"]) == (True, 3, 32)
    with pytest.raises(SystemExit, match="needs --enable-lora"):
        engine_kwargs(parser.parse_args(["serve", "--lora-modules", "a=/x"]))


async def test_async_generate_takes_a_lora_request(llm, lora_dir):
    from metrale_jax import LoRARequest, SamplingParams

    path = str(lora_dir / "chat/2.5")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    deltas = await llm.generate(PROMPT, params, lora_request=LoRARequest("gen", 77, path))
    text = "".join([d.text async for d in deltas])
    assert text == expected_text(llm, path, name="gen")


# ---- on the built-in model (needs the device side) --

async def test_real_model_server_serves_adapters_batched_as_alone(aiohttp_client):
    from tests.server_fixtures import ENGINE as REAL_ENGINE
    from tests.test_lora_engine import RandomAdapters

    loader = RandomAdapters()
    engine = AsyncLLM(None, enable_lora=True, max_loras=2, max_lora_rank=8,
                      adapter_loader=loader, **REAL_ENGINE)
    loader.model_config = engine.engine.model_config
    for name in ("a", "b", "c"):
        engine.register_adapter(name, f"/adapters/{name}")
    engine.start()
    try:
        client = await aiohttp_client(create_app(engine))
        c = oai(client)
        models = [engine.limits.model_name, "a", "b", "c"]
        alone = [await complete(c, m) for m in models]
        import asyncio
        together = await asyncio.gather(*(complete(c, m) for m in models))
        assert list(together) == alone
        assert alone[1] != alone[0]  # the adapter changes the output
        await c.close()
    finally:
        engine.shutdown(timeout=30)


def write_peft_adapter(directory, model_config, seed: int, rank: int = 4) -> None:
    """A PEFT LoRA directory by hand (adapter_config.json + adapter_model.safetensors) on
    the attention projections of a hybrid model (NemotronH names: backbone.layers.N.mixer)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from metrale_jax.lora.targets import block_targets

    rng = np.random.default_rng(seed)
    tensors = {}
    for i, kind in enumerate(model_config.layer_pattern):
        if kind != "A":
            continue
        for proj, (d_in, d_out) in block_targets(model_config, kind).items():
            key = f"base_model.model.backbone.layers.{i}.mixer.{proj}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.5, (rank, d_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.5, (d_out, rank)).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}))


async def test_real_model_loads_peft_directories_at_runtime(aiohttp_client, tmp_path):
    """`--lora-dir` with the real PEFT loader: load, use, unload through the endpoints."""
    from tests.server_fixtures import ENGINE as REAL_ENGINE

    engine = AsyncLLM(None, enable_lora=True, max_loras=1, max_lora_rank=8, **REAL_ENGINE)
    write_peft_adapter(tmp_path / "adapters" / "sql", engine.engine.model_config, seed=1)
    engine.start()
    try:
        app = create_app(engine, ServerConfig(lora_dir=str(tmp_path / "adapters")))
        client = await aiohttp_client(app)
        c = oai(client)
        status, text = await post(client, "/v1/load_lora_adapter",
                                  {"lora_name": "sql", "lora_path": "sql"})
        assert status == 200, text
        base = await complete(c, engine.limits.model_name)
        adapted = await complete(c, "sql")
        assert adapted != base
        assert await complete(c, "sql") == adapted
        status, text = await post(client, "/v1/load_lora_adapter",
                                  {"lora_name": "bad", "lora_path": "."})
        assert status == 400 and "adapter_config.json" in text
        status, _ = await post(client, "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert status == 200
        assert await complete(c, engine.limits.model_name) == base
        await c.close()
    finally:
        engine.shutdown(timeout=30)
