"""The hybrid language model: a stack of pre-norm residual blocks named by a layer pattern.

Every block is `x + mixer(norm(x))` where the mixer is attention, Mamba2 or an MLP; a Llama
layer is the two blocks "AF", a Mamba2 model is "M" repeated, NemotronH spells its own
pattern. MTP modules (DeepSeek-V3) draft further tokens from the final hidden state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from metrale_jax.config import ModelConfig
from metrale_jax.model.attention import Attention
from metrale_jax.model.batch import StepBatch
from metrale_jax.model.caches import DeviceCaches
from metrale_jax.model.layers import MLP, RMSNorm, apply_linear, dtype_of, linear
from metrale_jax.model.lora import LoraInputs
from metrale_jax.model.mamba2 import Mamba2Mixer
from pallas_kernels.backend import XLA, KernelOps, resolve


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, kind: str, rngs: nnx.Rngs):
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype_of(cfg))
        if kind == "A":
            self.mixer = Attention(cfg, rngs)
        elif kind == "M":
            self.mixer = Mamba2Mixer(cfg, rngs)
        else:
            self.mixer = MLP(cfg, rngs)


def run_blocks(blocks: nnx.List, x: Float[Array, "T D"], batch: StepBatch,
               kv: list, conv: list, ssm: list, kv_offset: int = 0, ssm_offset: int = 0,
               window: int = 0, keep: list | None = None, lora: LoraInputs | None = None,
               ) -> tuple[Float[Array, "T D"], int, int]:
    """Run blocks in order, threading each stateful block through its cache entry in place
    (the lists are updated); returns the hidden state and the next free cache indices.
    With `window` > 0 each Mamba2 block appends its per-position state candidates to `keep`
    (see `Mamba2Mixer`). `lora`: the tokens' adapters, by backbone block index."""
    ai, mi = kv_offset, ssm_offset
    for i, block in enumerate(blocks):
        adapters = lora.block(i) if lora is not None else None
        # Attention and the MLP take the pre-norm along (their first projection may run it).
        if block.kind == "A":
            h, kv[ai] = block.mixer(x, batch, kv[ai], adapters, norm=block.norm)
            ai += 1
        elif block.kind == "M":
            h, (conv[mi], ssm[mi]), candidates = block.mixer(block.norm(x), batch,
                                                             (conv[mi], ssm[mi]), window,
                                                             adapters)
            if keep is not None:
                keep.append(candidates)
            mi += 1
        else:
            h = block.mixer(x, adapters, norm=block.norm)
        x = x + h
    return x, ai, mi


class MTPModule(nnx.Module):
    """One DeepSeek-V3 MTP depth: [enorm(emb(next token)); hnorm(h)] -> proj -> blocks."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.norm_eps, dtype_of(cfg))
        self.hnorm = RMSNorm(d, cfg.norm_eps, dtype_of(cfg))
        self.eh_proj = linear(cfg, 2 * d, d, rngs)
        self.blocks = nnx.List([Block(cfg, k, rngs) for k in cfg.mtp_pattern])
        self.norm = RMSNorm(d, cfg.norm_eps, dtype_of(cfg))


class HybridLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype_of(cfg),
                               param_dtype=dtype_of(cfg),
                               embedding_init=nnx.initializers.normal(stddev=0.02), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, k, rngs) for k in cfg.layer_pattern])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype_of(cfg))
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs)
        self.mtp = nnx.List([MTPModule(cfg, rngs) for _ in range(cfg.num_mtp_modules)])
        self.ops = XLA  # static: the kernel set of the model-level ops (MTP acceptance)
        # Static: where `logits` puts its result (tensor parallel: replicated, the vocabulary
        # gathered from the shards of the LM head for the sampler; None: left as computed).
        self.logits_sharding = None

    def use_kernels(self, kernel_backend: str) -> KernelOps:
        """Route every attention and Mamba2 mixer (MTP ones too) through `kernel_backend`
        ("auto" | "pallas" | "xla", see pallas_kernels/backend.py); split the model after."""
        return self.use_ops(resolve(kernel_backend))

    def use_ops(self, ops: KernelOps) -> KernelOps:
        """Route every mixer and the model-level ops through `ops` (a `KernelOps`, or one
        with the same methods: parallel/ops.py runs them per shard); split the model after."""
        self.ops = ops
        for block in [*self.blocks, *(b for m in self.mtp for b in m.blocks)]:
            block.mixer.ops = ops  # attention, Mamba2 and MLP mixers alike
        return ops

    def __call__(self, batch: StepBatch, caches: DeviceCaches, lora: LoraInputs | None = None,
                 ) -> tuple[Float[Array, "T D"], DeviceCaches]:
        """The backbone over one ragged batch: final-normed hidden states and new caches.
        `lora`: each token's adapter (model/lora.py); None, the base model alone."""
        hidden, caches, _ = self.forward_keeping_states(batch, caches, window=0, lora=lora)
        return hidden, caches

    def forward_keeping_states(self, batch: StepBatch, caches: DeviceCaches, window: int,
                               lora: LoraInputs | None = None,
                               ) -> tuple[Float[Array, "T D"], DeviceCaches, list]:
        """The backbone, also returning each Mamba2 layer's state after each of the first
        `window` positions of every row (MTP verification rolls back to one of them)."""
        kv, conv, ssm = list(caches.kv), list(caches.conv), list(caches.ssm)
        keep: list = []
        x = self.embed(batch.token_ids)
        x, _, _ = run_blocks(self.blocks, x, batch, kv, conv, ssm, window=window, keep=keep,
                             lora=lora)
        return self.final_norm(x), DeviceCaches(tuple(kv), tuple(conv), tuple(ssm)), keep

    def logits(self, hidden: Float[Array, "N D"]) -> Float[Array, "N V"]:
        packed = getattr(self, "logits_packed", None)  # model/packing.py: tied_head
        if self.cfg.tie_word_embeddings and self.ops.reads_packed(hidden, packed):
            logits = self.ops.packed_product(hidden, packed, self.cfg.vocab_size)
        elif self.cfg.tie_word_embeddings:
            # f32 accumulation and result: on XLA:CPU a bf16 dot with a bf16 result is slow.
            logits = jnp.dot(hidden, self.embed.embedding[...].T,
                             preferred_element_type=jnp.float32).astype(jnp.float32)
        else:
            logits = self.ops.linear(self.lm_head, hidden).astype(jnp.float32)
        if self.logits_sharding is not None:
            # One all-gather of [N, V] rows; the sampler's sorts and top-k then run whole
            # on every device (XLA:CPU cannot partition a top-k over a split vocabulary).
            logits = jax.lax.with_sharding_constraint(logits, self.logits_sharding)
        return logits

    def mtp_forward(self, depth: int, hidden: Float[Array, "T D"], next_ids: Int[Array, "T"],
                    batch: StepBatch, caches: DeviceCaches,
                    ) -> tuple[Float[Array, "T D"], Float[Array, "T D"], DeviceCaches]:
        """MTP depth `depth` (0-based) at every token of the batch.

        `hidden` is the previous depth's output (the main model's final-normed hidden state
        for depth 0) and `next_ids` the token each position is followed by. Returns the
        module's output (the next depth's input), its normed state for `logits`, and the
        caches with this depth's K/V written.
        """
        module = self.mtp[depth]
        kv, conv, ssm = list(caches.kv), list(caches.conv), list(caches.ssm)
        x = apply_linear(module.eh_proj, jnp.concatenate(
            [module.enorm(self.embed(next_ids)), module.hnorm(hidden)], axis=-1))
        offset = len(self.cfg.attention_layers) + depth * self.cfg.mtp_pattern.count("A")
        # Base weights only: no adapter reaches the MTP layers (as vLLM, which applies LoRA
        # to no draft head). A draft is only a proposal; verification applies the row's
        # adapter, so what is emitted is exactly the adapted model's.
        x, _, _ = run_blocks(module.blocks, x, batch, kv, conv, ssm, kv_offset=offset)
        return x, module.norm(x), DeviceCaches(tuple(kv), tuple(conv), tuple(ssm))
