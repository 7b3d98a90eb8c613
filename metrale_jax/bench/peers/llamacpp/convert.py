"""The checkpoint as GGUF, by llama.cpp's own convert_hf_to_gguf.py, run in a subprocess."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from metrale_jax.bench.peers.llamacpp.locate import CONVERTER, find_llama_cpp_source

def gguf_output_path(checkpoint_dir: str | os.PathLike, out_path=None,
                     outtype: str = "f32") -> pathlib.Path:
    """Where the GGUF goes: `out_path`, else beside the checkpoint folder as
    `<name>-<outtype>.gguf`, so the checkpoint itself is never written to."""
    if out_path is not None:
        return pathlib.Path(out_path)
    ckpt = pathlib.Path(checkpoint_dir).resolve()
    return ckpt.parent / f"{ckpt.name}-{outtype}.gguf"


def _converter_inputs(checkpoint_dir: pathlib.Path) -> list[pathlib.Path]:
    """The files whose contents end up in the GGUF: weights, configs and the tokenizer."""
    patterns = ("*.safetensors", "*.bin", "*.json", "tokenizer.model")
    return [p for pattern in patterns for p in checkpoint_dir.glob(pattern) if p.is_file()]


def gguf_is_current(checkpoint_dir: str | os.PathLike, gguf: str | os.PathLike) -> bool:
    """True when `gguf` exists and is at least as new as every file it was made from."""
    gguf = pathlib.Path(gguf)
    inputs = _converter_inputs(pathlib.Path(checkpoint_dir))
    if not gguf.is_file() or not inputs:
        return False
    return gguf.stat().st_mtime >= max(p.stat().st_mtime for p in inputs)


def converter_command(source: pathlib.Path, checkpoint_dir, out_path, outtype: str) -> list[str]:
    """The converter run with this interpreter (it needs torch, sentencepiece, protobuf)."""
    return [sys.executable, str(pathlib.Path(source) / CONVERTER), str(checkpoint_dir),
            "--outfile", str(out_path), "--outtype", outtype]


def converter_env(source: pathlib.Path, base: dict | None = None) -> dict:
    """The environment with llama.cpp's gguf-py first on PYTHONPATH: the converter needs
    the gguf package of its own revision, which is not (and should not be) installed."""
    env = dict(os.environ if base is None else base)
    paths = [str(pathlib.Path(source) / "gguf-py")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def convert_to_gguf(checkpoint_dir: str | os.PathLike, out_path=None, *, outtype: str = "f32",
                    source: str | os.PathLike | None = None) -> pathlib.Path:
    """The checkpoint as a GGUF file, converted by llama.cpp's convert_hf_to_gguf.py unless
    an output at least as new as the checkpoint is already there."""
    ckpt = pathlib.Path(checkpoint_dir)
    out = gguf_output_path(ckpt, out_path, outtype)
    if gguf_is_current(ckpt, out):
        return out
    if not (ckpt / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt}: no config.json, not a Hugging Face checkpoint")
    src = find_llama_cpp_source(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name and renamed at the end, so that an interrupted run
    # never leaves a partial file that the freshness check would then reuse.
    partial = out.with_name(out.name + ".partial")
    proc = subprocess.run(converter_command(src, ckpt, partial, outtype),
                          env=converter_env(src), capture_output=True, text=True)
    if proc.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{CONVERTER} failed on {ckpt} (exit {proc.returncode}):\n"
                           + _tail(proc.stderr or proc.stdout))
    partial.replace(out)
    return out
