"""The aiohttp OpenAI-compatible server (built on the tick loop's streaming API)."""
