"""Which `PartitionSpec` each parameter and cache array gets on the mesh axis `tp`.

Megatron's split, written as shardings for XLA's partitioner (GSPMD) rather than as
hand-placed collectives: a projection that fans out to heads or MLP columns is split by its
output columns, the projection back to the model width by its input rows (XLA adds the
all-reduce), the vocabulary of the embedding and LM head is split too. Norm scales, the MTP
fusion projection and anything not named here are replicated: small, and replicating is
always correct.

Two choices worth their reasons:
* KV heads fewer than tp: `k_proj`/`v_proj` are replicated and the paged pool stores tp KV
  heads (`ParallelConfig.stored_kv_heads`): each device keeps only the KV head its query
  heads read, so the pool costs each device what one KV head costs, as in vLLM.
* Mamba2's conv state and conv weights are replicated: the conv runs over x, B and C side by
  side ([K-1, conv_dim] per slot, a few % of the SSM state [H, P, N]) and B/C are shared by
  every head of a group. The SSM state, the heads' parameters (A, dt bias, D, the gated norm)
  and `out_proj` rows are split by head. `in_proj` is split by columns where its width
  allows; its output [z | x | B | C | dt] is then re-laid per head by XLA.
A dimension that does not divide by tp (an odd vocabulary, an MLP width) is replicated rather
than refused: only head counts must divide (checked by `ParallelConfig.check_model`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

from metrale_jax.config import ModelConfig
from metrale_jax.model.caches import DeviceCaches

AXIS = "tp"
REPLICATED = P()

# Projections split by output columns (heads, MLP width, vocabulary) and by input rows.
COLUMN_SPLIT = frozenset({"q_proj", "gate_proj", "up_proj", "in_proj", "lm_head"})
ROW_SPLIT = frozenset({"o_proj", "down_proj", "out_proj"})
KV_PROJ = frozenset({"k_proj", "v_proj"})
# Mamba2 parameters with one entry per head, or per channel of the heads' inner width.
PER_HEAD = frozenset({"a_log", "dt_bias", "d_skip"})


def key_names(path: Sequence) -> tuple[str, ...]:
    """A pytree key path as plain names: ('blocks', '0', 'mixer', 'q_proj', 'kernel')."""
    names = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        names.append(str(name))
    if names and names[-1] == "value":  # nnx.Variable's own leaf
        names.pop()
    return tuple(names)


def param_spec(names: tuple[str, ...], shape: tuple[int, ...], cfg: ModelConfig,
               tp: int) -> P:
    """The spec of one parameter, from its path in the model's state and its shape."""
    leaf = names[-1]
    owner = names[-2] if len(names) > 1 else ""

    def split(axis: int) -> P:
        if shape[axis] % tp:
            return REPLICATED
        spec = [None] * len(shape)
        spec[axis] = AXIS
        return P(*spec)

    if owner == "embed" and leaf == "embedding":
        return split(0)                       # [V, D] by vocabulary
    if owner in COLUMN_SPLIT:
        return split(len(shape) - 1)          # kernel [in, out] and bias [out] by out
    if owner in ROW_SPLIT:
        return split(0) if leaf == "kernel" else REPLICATED
    if owner in KV_PROJ:
        return split(len(shape) - 1) if cfg.num_kv_heads % tp == 0 else REPLICATED
    if owner == "mixer" and leaf in PER_HEAD:
        return split(0)
    if owner == "norm" and len(names) > 2 and names[-3] == "mixer" and \
            shape[0] == cfg.mamba_inner:      # Mamba2's gated norm over the heads' width
        return split(0)
    return REPLICATED


def cache_specs(caches: DeviceCaches) -> DeviceCaches:
    """The pools' specs, in the caches' own structure: KV pages `[blocks, kv_heads, bs, hd]`
    and SSM states `[slots, heads, P, N]` by head; conv tails replicated (see above)."""
    by_head = P(None, AXIS, None, None)
    return DeviceCaches(kv=tuple((by_head, by_head) for _ in caches.kv),
                        conv=tuple(REPLICATED for _ in caches.conv),
                        ssm=tuple(by_head for _ in caches.ssm))


def axis_spec(ndim: int, axis: int) -> P:
    """A spec splitting dimension `axis` (negative counts from the end) of an ndim array."""
    spec = [None] * ndim
    spec[axis] = AXIS
    return P(*spec)


def param_specs(state_paths: Sequence[tuple], leaves: Sequence[jax.Array], cfg: ModelConfig,
                tp: int) -> list[P]:
    return [param_spec(key_names(path), tuple(x.shape), cfg, tp)
            for path, x in zip(state_paths, leaves)]
