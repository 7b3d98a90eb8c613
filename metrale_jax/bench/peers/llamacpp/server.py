"""llama-server for the serving benchmark, as a child process like our own server."""

from __future__ import annotations

import os

from metrale_jax.bench.peers.llamacpp.locate import default_threads, find_llama_server
from metrale_jax.bench.servers import ServerProcess, free_port


def server_command(binary: str | os.PathLike, gguf_path: str | os.PathLike, *, host: str,
                   port: int, parallel: int, ctx_per_slot: int, threads: int) -> list[str]:
    """The llama-server command line: `parallel` slots of `ctx_per_slot` tokens each."""
    if parallel < 1 or ctx_per_slot < 1 or threads < 1:
        raise ValueError(f"parallel, ctx_per_slot and threads must be positive: "
                         f"{parallel}, {ctx_per_slot}, {threads}")
    return [
        str(binary), "--model", str(gguf_path), "--host", host, "--port", str(port),
        "--parallel", str(parallel),
        # The context is shared out evenly among the slots.
        "--ctx-size", str(parallel * ctx_per_slot),
        "--threads", str(threads), "--threads-batch", str(threads),
        "--cont-batching",
        # Stated, though it is the default with an explicit --parallel: one KV stream per
        # slot, like run_offline.
        "--no-kv-unified",
        "--no-webui",
    ]


class LlamaServer(ServerProcess):
    """llama-server on 127.0.0.1 for the duration of a `with` block, healthy on entry.

    What its OpenAI-style `POST /v1/completions` does with `"prompt": [token ids]`,
    `"stream": true, "ignore_eos": true, "stream_options": {"include_usage": true}` (no
    "model" field needed): one `data: {...}` event per token, with `choices[0].text` and
    `finish_reason: null`; then one last event with `text: ""`, `finish_reason: "length"`,
    `usage` (completion_tokens, prompt_tokens, total_tokens, prompt_tokens_details.
    cached_tokens) and llama.cpp's `timings`; then `data: [DONE]`. `return_tokens` is
    ignored there (the native `/completion` honours it).

    Count output tokens from `usage`, not from events: the server holds back a token whose
    text ends in an incomplete UTF-8 character and sends its text with a later token's, or
    never when a random-weight model keeps emitting UTF-8 lead bytes (byte-fallback
    tokens); with llama-50m, 2 of 16 random prompts streamed 6 and 8 events for 128 tokens.
    It also keeps finished slots' caches: a prompt sent twice comes back with
    cached_tokens > 0, so benchmark prompts must differ.
    """

    def __init__(self, gguf_path: str | os.PathLike, *, port: int = 0, parallel: int,
                 ctx_per_slot: int, threads: int | None = None, binary: str | None = None,
                 log_path: str | os.PathLike | None = None, start_timeout_s: float = 120.0):
        self.host = "127.0.0.1"
        # llama-server accepts --port 0 but cannot say which port it took.
        self.port = port or free_port()
        command = server_command(find_llama_server(binary), gguf_path, host=self.host,
                                 port=self.port, parallel=parallel, ctx_per_slot=ctx_per_slot,
                                 threads=threads or default_threads())
        super().__init__("llama-server", command, f"http://{self.host}:{self.port}",
                         startup_timeout_s=start_timeout_s, log_path=log_path)
