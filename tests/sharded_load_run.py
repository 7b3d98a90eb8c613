"""Sharded loading against whole-load-then-place, run as its own process on 4 simulated CPU
devices: `python -m tests.sharded_load_run DIR` (tests/test_sharded_load.py).

The device count is set before jax is imported, which a pytest worker has already done.
For each checkpoint (a tiny Llama and a tiny NemotronH as Hugging Face safetensors, the
NemotronH saved as a metrale orbax checkpoint, the built-in model) and each tp, prints one
JSON line saying which leaves differ from the whole load placed by `place_params` (bit for
bit), which sit on the wrong sharding or hold the wrong shard shape on some device, which
were read bigger than one shard, and what `place_params` still had to move. Then one line
for the engine: `LLM(<tiny Llama>, tensor_parallel_size=2)` greedy against tp=1.
"""

from __future__ import annotations

import collections
import json
import math
import os
import pathlib
import sys

DEVICES = 4
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from metrale_jax.loader import hf_weights  # noqa: E402
from metrale_jax.loader.checkpoint import save_checkpoint  # noqa: E402
from metrale_jax.loader.resolve import load  # noqa: E402
from metrale_jax.parallel import placement as placement_module  # noqa: E402
from metrale_jax.parallel.config import ParallelConfig  # noqa: E402
from metrale_jax.parallel.specs import key_names  # noqa: E402

NEMOTRONH = dict(intermediate_size=128, mamba_num_heads=8, ssm_state_size=16,
                 max_position_embeddings=256,
                 layers_block_type=["linear_attention", "full_attention", "mlp"])
ENGINE = dict(block_size=8, num_kv_blocks=16, max_seq_len=64, max_batch_size=2,
              max_tokens_per_tick=16, prefill_chunk_size=16, seq_buckets=(2,),
              token_buckets=(16,), query_buckets=(16,), block_buckets=(8,),
              program_cache="none", warmup=False)


class Spy:
    """Records what the loaders read and put while loading: each part
    `SafetensorsReader.part` hands out (tensor, its size, the whole tensor's size), every
    whole-tensor read, and the shape of every host array put on a device (orbax puts each
    device's shard itself)."""

    def __init__(self):
        self.parts: list[tuple[str, int, int]] = []
        self.whole_reads: list[str] = []
        self.puts: list[tuple[int, ...]] = []
        self._undo = (hf_weights.SafetensorsReader.part, hf_weights.SafetensorsReader.read,
                      jax.device_put)
        part, read, put = self._undo

        def spy_part(reader, name, index):
            view = part(reader, name, index)
            self.parts.append((name, view.size, math.prod(reader.shape(name))))
            return view

        def spy_read(reader, name):
            self.whole_reads.append(name)
            return read(reader, name)

        def spy_put(x, *args, **kwargs):
            if isinstance(x, np.ndarray):
                self.puts.append(tuple(x.shape))
            return put(x, *args, **kwargs)

        hf_weights.SafetensorsReader.part = spy_part
        hf_weights.SafetensorsReader.read = spy_read
        jax.device_put = spy_put

    def close(self):
        (hf_weights.SafetensorsReader.part, hf_weights.SafetensorsReader.read,
         jax.device_put) = self._undo

    def reads(self, tp: int) -> dict[str, list[str]]:
        """Each tensor read by parts: in `tp` parts of a tp-th each (split), in one part
        whole (replicated), or otherwise (odd)."""
        sizes: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        for name, size, whole in self.parts:
            sizes[name].append((size, whole))
        kinds = collections.defaultdict(list)
        for name, reads in sorted(sizes.items()):
            whole = reads[0][1]
            kind = ("split" if reads == [(whole // tp, whole)] * tp else
                    "whole" if reads == [(whole, whole)] else "odd")
            kinds[kind].append(name)
        return kinds


def _leaves(model) -> list[tuple[tuple, jax.Array]]:
    _, state = nnx.split(model)
    return jax.tree_util.tree_flatten_with_path(state)[0]


def _name(path) -> str:
    return ".".join(key_names(path))


def check_load(name: str, model_dir: str | None, tp: int, whole, dtype: str | None = None,
               ) -> dict:
    """Load `model_dir` at `tp` (cast to `dtype`) under the spy; compare with `whole` (the
    one-device load, cast the same) placed by `place_params`."""
    placement = placement_module.param_placement(ParallelConfig(tp))
    spy = Spy()
    try:
        sharded = load(model_dir, dtype, placement=placement).model
    finally:
        spy.close()
    parallel = placement(sharded.cfg)
    got, want = _leaves(sharded), _leaves(whole)
    leaves = [x for _, x in got]
    shardings = parallel.param_shardings([p for p, _ in got], leaves)
    placed = parallel.place_params([p for p, _ in want], [x for _, x in want])
    kept = parallel.place_params([p for p, _ in got], leaves)
    # What each device should have received: its shard of every leaf, no more.
    shards = collections.Counter(s.shard_shape(x.shape) for x, s in zip(leaves, shardings)
                                 for _ in range(tp))
    reads = spy.reads(tp)
    return {
        "case": f"{name} tp={tp}" + (f" {dtype}" if dtype else ""), "leaves": len(got),
        "split_leaves": sum(not s.is_fully_replicated for s in shardings),
        "differ": [_name(p) for (p, x), y in zip(got, placed)
                   if x.dtype != y.dtype or not np.array_equal(np.asarray(x), np.asarray(y))],
        "wrong_sharding": [_name(p) for (p, x), s in zip(got, shardings)
                           if x.sharding != s or any(d.data.shape != s.shard_shape(x.shape)
                                                     for d in x.addressable_shards)],
        "moved_by_place_params": sum(a is not b for a, b in zip(kept, leaves)),
        "read_split": len(reads["split"]), "read_whole": len(reads["whole"]),
        "read_odd": reads["odd"], "whole_reads": spy.whole_reads,
        "puts_are_shards": (collections.Counter(spy.puts) == shards) if spy.puts else None,
    }


def engine_check(llama_dir: str) -> dict:
    """Greedy through `LLM` at tp=2 against tp=1, and how many parameters the runner's
    `place_params` still moved (0: they arrived on their shards)."""
    from metrale_jax import LLM, SamplingParams

    moved = []
    place = placement_module.TensorParallel.place_params

    def spy(self, paths, leaves):
        out = place(self, paths, leaves)
        moved.append(sum(a is not b for a, b in zip(out, leaves)))
        return out

    placement_module.TensorParallel.place_params = spy
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for tp in (1, 2):
        llm = LLM(llama_dir, tensor_parallel_size=tp, **ENGINE)
        try:
            outputs[tp] = llm.generate({"prompt_token_ids": list(range(5, 17))},
                                       params)[0].outputs[0].token_ids
        finally:
            llm.engine.close()
    return {"case": "engine", "tp1": outputs[1], "tp2": outputs[2], "moved": moved}


def tied_check(llama_dir: pathlib.Path, tmp: pathlib.Path) -> dict:
    """A tied checkpoint that still stores lm_head.weight loads sharded when the head is
    a copy of the embedding, and is refused when it is not (compared shard by shard)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(llama_dir / "model.safetensors")
    config = json.loads((llama_dir / "config.json").read_text())
    placement = placement_module.param_placement(ParallelConfig(2))
    result = {"case": "tied"}
    for kind, head in (("copy", tensors["model.embed_tokens.weight"]),
                       ("differs", tensors["model.embed_tokens.weight"] + 1)):
        path = tmp / f"tied-{kind}"
        path.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).write_bytes((llama_dir / name).read_bytes())
        (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
        save_file({**tensors, "lm_head.weight": head}, path / "model.safetensors")
        try:
            load(str(path), placement=placement)
            result[kind] = "loaded"
        except ValueError as e:
            result[kind] = str(e)
    return result


def main(tmp: pathlib.Path) -> None:
    from tests.hf_models import save_tiny_llama, save_tiny_nemotronh

    save_tiny_llama(tmp / "llama")
    save_tiny_nemotronh(tmp / "nemotronh", **NEMOTRONH)
    checkpoints = {"llama": str(tmp / "llama"), "nemotronh": str(tmp / "nemotronh"),
                   "nemotronh-orbax": str(tmp / "orbax")}
    wholes = {name: load(checkpoints[name]).model for name in ("llama", "nemotronh")}
    save_checkpoint(wholes["nemotronh"], tmp / "orbax")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp / "orbax" / name).write_bytes((tmp / "nemotronh" / name).read_bytes())
    wholes["nemotronh-orbax"] = load(checkpoints["nemotronh-orbax"]).model
    for name, path in checkpoints.items():
        for tp in (2, 4):
            print(json.dumps(check_load(name, path, tp, wholes[name])), flush=True)
        # Cast while loading (HF: per part on the host; orbax: on each device) against the
        # one-device load cast after.
        print(json.dumps(check_load(name, path, 2, load(path, "bfloat16").model,
                                    "bfloat16")), flush=True)
    print(json.dumps(check_load("default", None, 2, load(None).model)), flush=True)
    print(json.dumps(tied_check(tmp / "llama", tmp)), flush=True)
    print(json.dumps(engine_check(checkpoints["llama"])), flush=True)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
