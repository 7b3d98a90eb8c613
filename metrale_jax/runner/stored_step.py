"""The jitted step, with each variant's lowered program kept across starts.

A cached start used to trace the whole model and lower it to StableHLO for every warm-up
variant (~0.3-1 s each on 2 cores) only for JAX to hash the module and find its executable
in the persistent compilation cache. Here the first start exports each variant
(`jax.export`: the traced, lowered program) into a `ProgramStore`; later starts deserialize
it and call it through `jax.jit`, which lowers only a thin wrapper around the stored module
and finds that in JAX's cache. The cold start calls the same wrapper around the same module,
so the compiled program does not depend on whether the store had it.

The exported function takes and returns flat lists of arrays: the step's pytrees (custom
dataclass nodes) stay out of the export format; the output's structure is stored beside it.
Whatever fails here (a custom call export refuses, an unreadable entry) is logged and that
variant runs through the plain jitted step instead: slower to start, same results.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable

import jax

from metrale_jax.runner.program_store import ProgramStore

logger = logging.getLogger(__name__)

class StoredStep:
    """Drop-in for a jitted program of the step `fun(*args, layout, options)` (the forward:
    `(leaves, buffers, caches, tables, mask, lora)`; the sampler: `(logits, buffers,
    tables)`): one jitted call of a stored program per (layout, options), i.e. per shape
    and variant. The store key holds the options (`lora=True` or not) and the argument
    structure (LoRA slots or None), so a LoRA program and a plain one never mix."""

    def __init__(self, fun: Callable, fallback: Callable, store: ProgramStore, tag: str,
                 donated: tuple[int, ...], custom_calls: tuple[str, ...] = (),
                 compiler_options: dict | None = None):
        self._fun = fun              # the pure program, not jitted
        self._fallback = fallback    # the plain jitted one, for a variant that cannot export
        self._store = store
        self._tag = tag              # which program, and the model: config, kernel choice
        self._donated = donated      # positions of the donated arguments
        self._custom_calls = custom_calls  # our own FFI targets, exportable on this machine
        self._compiler_options = compiler_options  # XLA options, as the fallback's
        self._variants: dict[tuple, Callable | None] = {}

    def __call__(self, *args, layout, options):
        variant = self._variants.get((layout, options), ...)
        if variant is ...:
            variant = self._variants[(layout, options)] = self._build(args, layout, options)
        if variant is None:
            return self._fallback(*args, layout=layout, options=options)
        return variant(*args)

    def lower(self, *args, layout, options):
        """The variant's lowering, for compiling it ahead of its first call (`args` may be
        `jax.ShapeDtypeStruct`s: nothing runs)."""
        variant = self._variants.get((layout, options), ...)
        if variant is ...:
            variant = self._variants[(layout, options)] = self._build(args, layout, options)
        if variant is None:
            return self._fallback.lower(*args, layout=layout, options=options)
        return variant.lower(*args)

    def _cache_size(self) -> int:
        """Compiled entries, counted as `jax.jit` counts its own (tests watch this)."""
        return self._fallback._cache_size() + sum(
            v._cache_size() for v in self._variants.values() if v is not None)

    def _build(self, args: tuple, layout, options) -> Callable | None:
        flat, in_tree = jax.tree.flatten(args)
        donated = _donated_positions(args, self._donated)
        key = self._key(flat, in_tree, layout, options, donated)
        loaded = self._load(key)
        if loaded is None:
            try:
                loaded = self._export(flat, in_tree, layout, options, donated)
            except Exception as err:  # noqa: BLE001 - any export failure: use the plain jit
                logger.warning("a step variant cannot be exported (%s: %s); compiling it "
                               "directly", type(err).__name__, err)
                return None
            self._save(key, *loaded)
        exported, out_tree = loaded

        def call_stored(*structured):
            # Traced once per variant; jit's C++ path flattens the arguments on each call.
            return jax.tree.unflatten(out_tree, exported.call(*jax.tree.leaves(structured)))

        return jax.jit(call_stored, donate_argnums=self._donated,
                       compiler_options=self._compiler_options)

    def _save(self, key: str, exported, out_tree) -> None:
        try:  # serialization needs `flatbuffers`; without it this start still runs
            payload = pickle.dumps({"exported": bytes(exported.serialize()), "out_tree": out_tree})
        except Exception as err:  # noqa: BLE001
            logger.warning("program store: cannot serialize a step variant (%s: %s)",
                           type(err).__name__, err)
            return
        self._store.save(key, payload)

    def _load(self, key: str):
        payload = self._store.load(key)
        if payload is None:
            return None
        try:
            entry = pickle.loads(payload)
            return jax.export.deserialize(bytearray(entry["exported"])), entry["out_tree"]
        except Exception as err:  # noqa: BLE001 - a bad entry is a miss, never a failure
            logger.warning("program store: cannot load %s (%s: %s); building it anew",
                           self._store.path_for(key), type(err).__name__, err)
            return None

    def _export(self, flat: list, in_tree, layout, options, donated: tuple[int, ...]):
        out_trees = []

        def flat_step(*leaves):
            out = self._fun(*jax.tree.unflatten(in_tree, leaves), layout=layout,
                            options=options)
            out_leaves, out_tree = jax.tree.flatten(out)
            out_trees.append(out_tree)
            return out_leaves

        checks = [jax.export.DisabledSafetyCheck.custom_call(n) for n in self._custom_calls]
        exported = jax.export.export(jax.jit(flat_step, donate_argnums=donated),
                                     disabled_checks=checks)(*flat)
        return exported, out_trees[0]

    def _key(self, flat: list, in_tree, layout, options, donated: tuple[int, ...]) -> str:
        avals = "; ".join(f"{x.dtype}{list(x.shape)}{'w' if _weak(x) else ''}" for x in flat)
        return "\n".join(["program step", f"model {self._tag}", f"layout {layout!r}",
                          f"options {options!r}", f"in_tree {in_tree}",
                          f"donated {list(donated)}", f"avals {avals}"])


def _donated_positions(args: tuple, donated: tuple[int, ...]) -> tuple[int, ...]:
    """Flat indices of the leaves of the donated arguments."""
    start, positions = 0, []
    for i, arg in enumerate(args):
        n = len(jax.tree.leaves(arg))
        if i in donated:
            positions.extend(range(start, start + n))
        start += n
    return tuple(positions)


def _weak(x) -> bool:
    return bool(getattr(getattr(x, "aval", x), "weak_type", False))  # an array or its struct
