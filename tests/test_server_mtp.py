"""Speculative decoding through the server: the official `openai` client gets the same
greedy text with MTP on as the offline plain engine; the admin snapshot shows the gate's
mode and delivered tokens/s, the `mtp_policy` lever turns it, and /metrics carries the
spec-decode counters."""

from __future__ import annotations

import re

import openai
import pytest

from metrale_jax.async_engine import AsyncLLM
from metrale_jax.engine import LLM
from metrale_jax.request import SamplingParams
from server.app import create_app
from tests.server_fixtures import ENGINE, MODEL

SPEC = {"method": "mtp", "num_speculative_tokens": 2, "gate": "on"}


@pytest.fixture(scope="module")
def llm():
    engine = AsyncLLM(MODEL, **ENGINE, speculative_config=SPEC)
    engine.start()
    yield engine
    engine.shutdown(timeout=30)


@pytest.fixture
async def client(llm, aiohttp_client):
    return await aiohttp_client(create_app(llm), server_kwargs={"handler_cancellation": True})


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text,
                      re.M)
    assert match, name
    return float(match.group(1))


async def test_openai_client_text_equals_plain_offline(client, llm):
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none",
                             max_retries=0)
    prompt = "ROMEO:\n"
    got = await api.completions.create(model=llm.engine.model_name, prompt=prompt,
                                       max_tokens=24, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    plain = LLM(MODEL, **ENGINE, warmup=False).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert got.choices[0].text == plain[0].outputs[0].text

    snap = (await (await client.get("/v1/admin/snapshot")).json())["snapshot"]
    assert snap["mtp_mode"] == "on" and snap["delivered_tps"] > 0
    text = await (await client.get("/metrics")).text()
    drafts = _metric(text, "metrale:spec_decode_num_drafts_total")
    draft_tokens = _metric(text, "metrale:spec_decode_num_draft_tokens_total")
    accepted = _metric(text, "metrale:spec_decode_num_accepted_tokens_total")
    first = _metric(text, "metrale:spec_decode_num_accepted_tokens_per_pos_total",
                    'position="0"')
    assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens
    assert 0 < first <= accepted
    assert _metric(text, "metrale:mtp_mode", 'mode="on"') == 1.0


async def test_mtp_policy_lever(client):
    levers = await (await client.get("/v1/admin/levers")).json()
    assert levers["mtp_policy"] == "on"
    resp = await client.post("/v1/admin/levers", json={"mtp_policy": "sometimes"})
    assert resp.status == 400 and "mtp_policy" in (await resp.text())
    resp = await client.post("/v1/admin/levers", json={"mtp_policy": "off"})
    assert resp.status == 200
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                      "temperature": 0.0})
    assert resp.status == 200
    snap = (await (await client.get("/v1/admin/snapshot")).json())["snapshot"]
    assert snap["mtp_mode"] == "off"
    await client.post("/v1/admin/levers", json={"mtp_policy": "on"})
