"""Training for metrale models: the built-in default model's recipe, reusable for others.

1. `corpus` fetches and cleans the text (Shakespeare, public domain) and splits off held-out
   works; `data` turns it into token streams and resumable batches of windows.
2. `step` is the pure, jitted step: the model's own ragged paged forward, next-token loss plus
   the DeepSeek-V3 MTP loss per depth, AdamW with warm-up + cosine decay and clipping.
3. `trainer` runs the loop (tqdm, validation at intervals, orbax checkpoints that resume
   bit-exactly); `cli` is `metrale train`.
"""
