"""Configuration: one frozen, hashable dataclass per concern.

`ModelConfig` describes the network (it is a static argument of every jitted step, so it
must hash); `EngineConfig` describes how the engine lays out memory and batches work.
Validation happens in `__post_init__` and every message names the offending field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from metrale_jax.lora.config import LoraConfig
from metrale_jax.parallel.config import ParallelConfig
from metrale_jax.spec.config import SpeculativeConfig

# A layer pattern is a string with one character per residual block:
#   A = attention mixer, M = Mamba2 mixer, F = feed-forward (MLP).
# A Llama layer is "AF"; NemotronH writes its own hybrid pattern directly.
BLOCK_KINDS = {"A": "attention", "M": "mamba", "F": "mlp"}
MLP_KINDS = ("gated_silu", "relu2")
ROPE_SCALINGS = ("none", "linear", "llama3")
KERNEL_BACKENDS = ("auto", "pallas", "xla")
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", *DTYPES)
LADDERS = ("sparse", "pow2")
# Grammar engines for structured outputs (metrale_jax/grammar/backend.py).
GRAMMAR_BACKENDS = ("llguidance", "xgrammar")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _require(ok: bool, field_name: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {why}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    layer_pattern: str  # one char per block, see BLOCK_KINDS
    # Attention.
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 64
    use_rope: bool = True  # NemotronH attention has no positional encoding
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    # (factor, low_freq_factor, high_freq_factor, original_max_position) for llama3;
    # (factor,) for linear. A tuple keeps the config hashable.
    rope_scaling_args: tuple[float, ...] = ()
    qk_norm: bool = False  # Qwen3 normalises each head's q and k before RoPE
    # MLP.
    intermediate_size: int = 1024
    mlp_kind: str = "gated_silu"
    # Mamba2.
    ssm_state_size: int = 16
    conv_kernel: int = 4
    mamba_num_heads: int = 8
    mamba_head_dim: int = 32
    mamba_groups: int = 1
    mamba_chunk_size: int = 64
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_groups: int = 1  # gated RMSNorm over this many groups of the inner width
    # dt is clamped into [time_step_min, time_step_max] after softplus (NemotronH: 1e-3, inf).
    time_step_min: float = 0.0
    time_step_max: float = float("inf")
    # Multi-token prediction (DeepSeek-V3 style); each module is one `mtp_pattern` block.
    num_mtp_modules: int = 0
    mtp_pattern: str = "AF"
    tie_word_embeddings: bool = False
    norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    dtype: str = "float32"  # activations and weights; SSM state is always float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "ssm_state_size", "conv_kernel", "mamba_num_heads",
                     "mamba_head_dim", "mamba_groups", "mamba_chunk_size", "mamba_norm_groups",
                     "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        _require(len(self.layer_pattern) > 0, "layer_pattern", "must name at least one block")
        for pattern_name in ("layer_pattern", "mtp_pattern"):
            bad = set(getattr(self, pattern_name)) - set(BLOCK_KINDS)
            _require(not bad, pattern_name,
                     f"unknown block kinds {sorted(bad)}; use A (attention), M (mamba), F (mlp)")
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                 f"{self.num_kv_heads} must divide num_heads={self.num_heads}")
        _require(self.mamba_num_heads % self.mamba_groups == 0, "mamba_groups",
                 f"{self.mamba_groups} must divide mamba_num_heads={self.mamba_num_heads}")
        _require(self.mamba_inner % self.mamba_norm_groups == 0, "mamba_norm_groups",
                 f"{self.mamba_norm_groups} must divide the inner width {self.mamba_inner}")
        _require(self.conv_kernel >= 2, "conv_kernel", "must be at least 2")
        _require(self.mlp_kind in MLP_KINDS, "mlp_kind", f"must be one of {MLP_KINDS}")
        _require(self.rope_scaling in ROPE_SCALINGS, "rope_scaling",
                 f"must be one of {ROPE_SCALINGS}, got {self.rope_scaling!r}")
        _require(self.num_mtp_modules >= 0, "num_mtp_modules", "must be >= 0")
        _require("M" not in self.mtp_pattern, "mtp_pattern",
                 "MTP blocks may hold attention and MLP blocks only")
        _require(self.dtype in DTYPES, "dtype",
                 f"unsupported dtype {self.dtype!r}")

    @property
    def mamba_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: x, B and C side by side."""
        return self.mamba_inner + 2 * self.mamba_groups * self.ssm_state_size

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_pattern) if k == "A")

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_pattern) if k == "M")

    @property
    def num_mtp_attention_layers(self) -> int:
        return self.num_mtp_modules * self.mtp_pattern.count("A")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _parse_section(cls, value, name: str):
    """An EngineConfig section given as the object, a dict of its fields, or None (its
    defaults); anything else, or an unknown field, is an error naming the section."""
    if value is None:
        return cls()
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{name}: unknown field(s) {unknown}")
        return cls(**value)
    if not isinstance(value, cls):
        raise ValueError(f"{name}: expected a {cls.__name__} or a dict, got "
                         f"{type(value).__name__}")
    return value


@dataclass(frozen=True)
class SessionConfig:
    """Multi-turn sessions (scheduler/sessions.py): how long an idle one lives and what
    its pinned turns may hold."""

    ttl_s: float = 600.0               # an idle session ends after this many seconds
    max_sessions: int = 1024           # open sessions; the least recently used idle goes
    max_session_blocks: int = 512      # KV blocks one session may pin (a longer turn isn't)
    max_pinned_fraction: float = 0.5   # of the KV pool and of the SSM snapshot slots
    # The second tier: a tail memory pressure takes off the device goes to host RAM, then
    # to disk (the spill store's files, under the engine's spill directory), and comes
    # back for the session's next turn. 0 turns a level off.
    host_tier_bytes: int = 512 * 1024 * 1024
    disk_tier_bytes: int = 2 * 1024 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("ttl_s", "max_sessions", "max_session_blocks"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sessions.{name}: must be positive, got "
                                 f"{getattr(self, name)}")
        for name in ("host_tier_bytes", "disk_tier_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"sessions.{name}: must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"sessions.max_pinned_fraction: must be in [0, 1], got "
                             f"{self.max_pinned_fraction}")

    @classmethod
    def parse(cls, value: "SessionConfig | dict | None") -> "SessionConfig":
        return _parse_section(cls, value, "sessions")


@dataclass(frozen=True)
class PrefixTierConfig:
    """The prefix tier (scheduler/prefix_tier.py): cached prefix blocks and SSM snapshots
    the device evicts go to host RAM, then to disk (the spill store's files, under the
    engine's spill directory), and come back on a prefix hit. Off by default (both 0), as
    vLLM's KV offloading and SGLang's HiCache are: every eviction then copies the block's
    pages to the host."""

    host_bytes: int = 0
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"prefix_tier.{name}: must be an int >= 0, got "
                                 f"{getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0

    @classmethod
    def parse(cls, value: "PrefixTierConfig | dict | None") -> "PrefixTierConfig":
        return _parse_section(cls, value, "prefix_tier")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    # The KV pool holds `num_kv_blocks` blocks (block 0 is the null block); when None it is
    # sized from `kv_memory_bytes`.
    num_kv_blocks: int | None = None
    kv_memory_bytes: int = 256 * 1024 * 1024
    max_seq_len: int = 2048
    max_batch_size: int = 64
    max_tokens_per_tick: int = 512  # the ragged batch's token budget
    # Bucket ladders: the padded shapes a step is compiled for (see runner/buckets.py).
    # Empty tuples mean the `ladders` default below.
    token_buckets: tuple[int, ...] = ()
    seq_buckets: tuple[int, ...] = ()
    # Rows of a step that carries prefill chunks (empty: seq_buckets). Decode steps are cheap
    # to compile and padding their rows costs every token, so they get a fine ladder; prefill
    # steps are dominated by their tokens and can share a coarse one, keeping warm-up short.
    prefill_seq_buckets: tuple[int, ...] = ()
    query_buckets: tuple[int, ...] = ()
    block_buckets: tuple[int, ...] = ()  # block-table widths; the last must cover max_seq_len
    # What an empty ladder above becomes: "sparse" (a few sizes: ~20 shapes to warm up at the
    # server's limits) or "pow2" (every power of two: finer padding, hundreds of shapes).
    ladders: str = "sparse"
    max_logprobs: int = 20  # top-n logprobs computed on the device for every row
    # Logit-bias entries one request may carry (with min_tokens, its stop token ids and EOS
    # count too): each sequence slot keeps a device table this wide, so no request's bias
    # is a new shape to compile.
    max_logit_bias: int = 1024
    # Scheduling: the starting values of the runtime levers (scheduler/levers.py).
    prefill_chunk_size: int = 256      # longest prefill chunk of one sequence per tick
    admit_watermark: float = 0.01      # fraction of KV blocks admission keeps free
    enable_prefix_cache: bool = True
    enable_pipeline: bool = True       # dispatch step N+1 before reading step N back
    enable_swap: bool = True           # spill to disk instead of recomputing
    spill_dir: str | None = None       # None: a private temporary directory
    policy: str = "fcfs"               # admission policy: fcfs | priority
    num_ssm_snapshots: int = 16        # SSM snapshot slots for prefix reuse on hybrids
    kernel_backend: str = "auto"
    # The KV pool's dtype, apart from the weights': "auto" is the model's dtype, except on the
    # CPU without its attention kernel, or for an f32/f16 model there: float32 (XLA:CPU has
    # no fast bf16 path for the attention mat-vecs). See model/caches.kv_cache_dtype.
    kv_cache_dtype: str = "auto"
    seed: int = 0
    # Speculative decoding with the model's MTP modules (None: off); see spec/config.py.
    speculative: SpeculativeConfig | None = None
    # Where each step variant's lowered program is kept so that later starts skip tracing
    # (runner/stored_step.py): "auto" is inside JAX's persistent compilation cache directory
    # when one is set, "none" turns it off, anything else is a directory.
    program_cache: str = "auto"
    # Multi-LoRA (None: off; no adapter slots are allocated and no step does LoRA work).
    lora: LoraConfig | None = None
    # The grammar engine of structured outputs: "llguidance" (a dependency) or "xgrammar"
    # (extra `grammar-xgrammar`). Checked at startup, so a missing package fails there.
    structured_outputs_backend: str = "llguidance"
    # How the model is spread over devices (metrale_jax/parallel/): tensor parallel size.
    parallel: ParallelConfig = ParallelConfig()
    # Multi-turn sessions: TTL and pinning budgets (a dict becomes the validated object).
    sessions: SessionConfig = SessionConfig()
    # The prefix tier for evicted prefix blocks and SSM snapshots (a dict becomes the object).
    prefix_tier: PrefixTierConfig = PrefixTierConfig()

    def __post_init__(self) -> None:
        # A dict or JSON text (vLLM's shape) becomes the validated object.
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        _require(isinstance(self.parallel, ParallelConfig), "parallel",
                 f"must be a ParallelConfig, got {type(self.parallel).__name__}")
        object.__setattr__(self, "sessions", SessionConfig.parse(self.sessions))
        object.__setattr__(self, "prefix_tier", PrefixTierConfig.parse(self.prefix_tier))
        for name in ("block_size", "kv_memory_bytes", "max_seq_len", "max_batch_size",
                     "max_tokens_per_tick"):
            _require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None:
            _require(self.num_kv_blocks >= 2, "num_kv_blocks",
                     "needs the null block plus at least one usable block")
        _require(self.max_tokens_per_tick >= self.max_batch_size, "max_tokens_per_tick",
                 "must be at least max_batch_size so every running sequence can decode")
        _require(self.max_logprobs >= 1, "max_logprobs", "must be >= 1")
        _require(self.max_logit_bias >= 1, "max_logit_bias", "must be >= 1")
        _require(self.prefill_chunk_size >= 1, "prefill_chunk_size", "must be positive")
        _require(0.0 <= self.admit_watermark < 1.0, "admit_watermark", "must be in [0, 1)")
        _require(self.policy in ("fcfs", "priority"), "policy",
                 f"must be fcfs or priority, got {self.policy!r}")
        _require(self.num_ssm_snapshots >= 0, "num_ssm_snapshots", "must be >= 0")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.ladders in LADDERS, "ladders",
                 f"must be one of {LADDERS}, got {self.ladders!r}")
        _require(self.kernel_backend in KERNEL_BACKENDS, "kernel_backend",
                 f"must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        _require(self.structured_outputs_backend in GRAMMAR_BACKENDS,
                 "structured_outputs_backend", f"must be one of {GRAMMAR_BACKENDS}, got "
                 f"{self.structured_outputs_backend!r}")
        for name, limit in (("token_buckets", self.max_tokens_per_tick),
                            ("seq_buckets", self.max_batch_size),
                            ("prefill_seq_buckets", self.max_batch_size),
                            ("query_buckets", min(self.max_tokens_per_tick, self.max_seq_len))):
            ladder = getattr(self, name)
            _require(not ladder or ladder[-1] >= limit, name,
                     f"the largest bucket must be at least {limit}")
        if self.block_buckets:
            _require(self.block_buckets[-1] >= self.max_blocks_per_seq, "block_buckets",
                     f"the largest must cover max_seq_len ({self.max_blocks_per_seq} blocks)")
        for name in ("token_buckets", "seq_buckets", "prefill_seq_buckets", "query_buckets",
                     "block_buckets"):
            ladder = getattr(self, name)
            _require(list(ladder) == sorted(set(ladder)) and all(b > 0 for b in ladder), name,
                     "must be strictly increasing positive sizes")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
