"""A Llama-shaped Hugging Face checkpoint made here with transformers, for benchmarking
against peers on the same weights.

Its tokenizer is a SentencePiece `tokenizer.model` trained locally, because llama.cpp's GGUF
converter refuses home-made BPE `tokenizer.json` files but converts SentencePiece Llama
checkpoints. Weights are randomly initialised (seeded): speed does not depend on their values,
and every engine is told to ignore end-of-sequence, so all of them generate the same lengths.
The head's rows for special and byte-fallback pieces are zeroed so that every generated token
streams as whole text (see `unstreamable_ids`).
"""

from __future__ import annotations

import dataclasses
import io
import math
import pathlib


@dataclasses.dataclass(frozen=True)
class LlamaPreset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int = 2048


PRESETS = {
    # ~49.5M parameters: 41.3M in 12 blocks, 8.2M in the (untied) embedding and head.
    "llama-50m": LlamaPreset(8000, 512, 1536, 12, 8, 8),
    # For smoke tests: seconds to make, convert and run.
    "llama-tiny": LlamaPreset(512, 64, 128, 2, 4, 2, 512),
}


def train_sentencepiece(text: str, vocab_size: int, out_dir: pathlib.Path) -> pathlib.Path:
    """A Llama-style SentencePiece model (BPE, byte fallback, <unk>=0 <s>=1 </s>=2)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    lines = (line for line in text.splitlines() if line.strip())
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        max_sentence_length=1 << 16, num_threads=2, minloglevel=2)
    path = out_dir / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    return path


def corpus_text(text_file: str | None) -> str:
    if text_file is not None:
        return pathlib.Path(text_file).read_text()
    from metrale_jax.train.corpus import DEFAULT_CACHE, load_corpus

    return "\n".join(load_corpus(DEFAULT_CACHE).train.values())


def make_llama_checkpoint(out_dir: str | pathlib.Path, preset: str = "llama-50m", *,
                          text_file: str | None = None, seed: int = 0,
                          dtype: str = "float32") -> pathlib.Path:
    """Write config.json, model.safetensors, tokenizer.model and tokenizer.json to `out_dir`.
    `dtype` ("float32" or "bfloat16"): the stored weights'; the same seed gives the same
    weights, rounded, in either (so an f32 and a bf16 comparison run one model)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype: must be 'float32' or 'bfloat16', got {dtype!r}")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

    if preset not in PRESETS:
        raise ValueError(f"preset: {preset!r} is not one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_sentencepiece(corpus_text(text_file), p.vocab_size, out)
    # Loading from the folder converts tokenizer.model into a tokenizer.json beside it.
    LlamaTokenizer.from_pretrained(out).save_pretrained(out)
    config = LlamaConfig(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size, num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_position_embeddings, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight[unstreamable_ids(out / "tokenizer.model")] = 0.0
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    return out


def unstreamable_ids(spm_path: pathlib.Path) -> list[int]:
    """Special and byte-fallback pieces. Their head rows are zeroed, so their logit is 0
    while the best of thousands of random logits is well above it: greedy decoding never
    picks them. Otherwise a random model loops on UTF-8 lead bytes, which servers hold
    back as incomplete characters, and streamed token timings lose their meaning."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    return [i for i in range(sp.get_piece_size())
            if sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i)]


def count_parameters(checkpoint: str | pathlib.Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(pathlib.Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            for key in st.keys():
                total += math.prod(st.get_slice(key).get_shape())
    return total


def make_nemotronh_checkpoint(out_dir: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A NemotronH-shaped hybrid (Mamba2, attention and MLP layers in NVIDIA's pattern,
    random weights) with the built-in model's tokenizer: about 11M parameters, for the
    hybrid benchmarks (`metrale bench sessions --model ...`)."""
    import shutil

    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from metrale_jax.default_model import ASSET_DIR

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    pattern = ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp",
               "linear_attention", "mlp", "linear_attention", "full_attention", "mlp"]
    config = NemotronHConfig(
        vocab_size=4096, hidden_size=384, num_attention_heads=6, num_key_value_heads=2,
        head_dim=64, mamba_num_heads=12, mamba_head_dim=64, ssm_state_size=64, n_groups=2,
        chunk_size=128, intermediate_size=1024, max_position_embeddings=4096,
        layers_block_type=pattern, initializer_range=0.05, torch_dtype="float32")
    NemotronHForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET_DIR / name, out / name)
    return out
