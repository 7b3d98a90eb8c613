"""The adapter registry and LoRARequest (host only): names, ids, versions, LRU slots."""

from __future__ import annotations

import pytest

from metrale_jax import LoRARequest
from metrale_jax.lora.registry import AdapterRegistry
from metrale_jax.lora.weights import LoraError
from tests.scheduler_harness import fake_weights


class RecordingLoader:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, name: str, path: str):
        self.calls.append((name, path))
        if "missing" in path:
            raise FileNotFoundError(path)
        return fake_weights(name)


def test_lora_request_is_vllm_shaped_and_validated():
    r = LoRARequest("sql", 1, "/adapters/sql")
    assert (r.lora_name, r.lora_int_id, r.lora_path) == ("sql", 1, "/adapters/sql")
    assert (r.name, r.path) == ("sql", "/adapters/sql")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("sql", 0, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/adapters/sql")


def test_ensure_reads_once_and_keeps_names_consistent():
    loader = RecordingLoader()
    reg = AdapterRegistry(2, loader)
    a = reg.ensure(LoRARequest("a", 1, "/adapters/a"))
    assert reg.ensure(LoRARequest("a", 1, "/adapters/a")) is a
    assert loader.calls == [("a", "/adapters/a")]
    with pytest.raises(LoraError, match="registered as id 1"):
        reg.ensure(LoRARequest("a", 2, "/adapters/a"))
    with pytest.raises(LoraError, match="lora_int_id: 1"):
        reg.ensure(LoRARequest("b", 1, "/adapters/b"))
    with pytest.raises(LoraError, match="cannot read"):
        reg.ensure(LoRARequest("c", 3, "/adapters/missing"))
    assert "c" not in reg and a.slot == 0  # registering loads nothing onto the device


def test_register_refuses_a_taken_name_and_numbers_server_adapters():
    reg = AdapterRegistry(1, RecordingLoader())
    a = reg.register("a", "/a", fake_weights("a"))
    b = reg.register("b", "/b", fake_weights("b"))
    assert a.int_id != b.int_id and a.version != b.version
    with pytest.raises(LoraError, match="already loaded"):
        reg.register("a", "/a", fake_weights("a"))


def test_choose_slot_prefers_free_then_least_recently_used_not_kept():
    reg = AdapterRegistry(2, RecordingLoader())
    a, b, c = (reg.register(n, f"/{n}", fake_weights(n)) for n in "abc")
    assert reg.choose_slot(keep=()) == 1
    reg.place(a, 1)
    assert reg.choose_slot(keep=()) == 2
    reg.place(b, 2)
    reg.touch(a, tick=5)
    reg.touch(b, tick=9)
    assert reg.choose_slot(keep=()) == 1           # a is least recently used
    assert reg.choose_slot(keep={"a"}) == 2        # a is held: b goes
    assert reg.choose_slot(keep={"a", "b"}) is None
    evicted = reg.place(c, 1)
    assert evicted is a and a.slot == 0 and c.slot == 1
    assert [x.name for x in reg.resident()] == ["c", "b"]


def test_replace_gives_a_new_version_in_the_same_slot_and_remove_frees_it():
    reg = AdapterRegistry(1, RecordingLoader())
    a = reg.register("a", "/a", fake_weights("a"))
    reg.place(a, 1)
    new = reg.replace("a", "/a2", fake_weights("a", 2.0))
    assert new.version != a.version and new.slot == 1 and new.int_id == a.int_id
    assert reg.get("a") is new and reg.name_of(new.version) == "a"
    assert reg.name_of(a.version) is None
    reg.remove("a")
    assert reg.resident() == [] and reg.choose_slot(keep=()) == 1
    with pytest.raises(LoraError, match="not loaded"):
        reg.remove("a")
