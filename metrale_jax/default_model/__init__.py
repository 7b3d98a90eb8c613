"""Built-in model assets shipped with metrale_jax, so the engine runs with no download."""

import pathlib

ASSET_DIR = pathlib.Path(__file__).parent
