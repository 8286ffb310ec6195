"""Writes the default workloads (seeded, so the files are reproducible).

offline_default.jsonl: chat prompts with heavy-tailed output lengths (log-normal, clipped),
ignore_eos so every system generates exactly the same number of tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = [
    "the water cycle",
    "how vaccines work",
    "the French revolution",
    "black holes",
    "photosynthesis",
    "the history of the bicycle",
    "how a compiler works",
    "coral reefs",
    "the stock market",
    "volcanoes",
    "machine learning",
    "the Roman empire",
    "bees",
    "the internet",
    "climate change",
    "chess openings",
    "the human heart",
    "electric cars",
    "the moon landing",
    "jazz music",
    "earthquakes",
    "the printing press",
    "honey",
    "glaciers",
]
STYLES = [
    "Explain {t} to a ten-year-old.",
    "Write a short poem about {t}.",
    "Give three surprising facts about {t}.",
    "Summarize {t} in one paragraph.",
    "Write a detailed essay about {t}, with an introduction, three sections and a conclusion.",
    "What are the pros and cons of {t}?",
    "Tell a short story that involves {t}.",
]


def heavy_tailed(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(rng.lognormvariate(0.0, sigma) * median)))


def offline_default(n: int = 256, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = rng.choice(STYLES).format(t=rng.choice(TOPICS))
        rows.append(
            {
                "prompt": prompt,
                "max_tokens": heavy_tailed(rng, 48, 1.0, 8, 512),
                "temperature": 0.0,
                "ignore_eos": True,
            }
        )
    return rows


SENTENCES = [
    "The committee reviewed the quarterly figures and noted a steady rise in demand.",
    "Engineers replaced the aging pumps with quieter models during the spring shutdown.",
    "Several residents asked whether the new bus route would reach the hospital.",
    "The library extended its opening hours after a survey of students.",
    "Rainfall in the northern valleys was twice the seasonal average.",
    "A volunteer group restored the old footbridge over the river.",
    "The bakery on the corner started selling bread made from local grain.",
    "Teachers reported that the new reading program improved attendance.",
]


def long_document(rng: random.Random, sentences: int) -> str:
    return " ".join(rng.choice(SENTENCES) for _ in range(sentences))


def serving_default(n: int = 80, long_share: float = 0.15, seed: int = 1) -> list[dict]:
    """Short chats with a few long documents to summarise mixed in: the long prefills are
    what disaggregation keeps away from the decode batch."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        if rng.random() < long_share:
            doc = long_document(rng, 110)  # about 1,500 tokens
            rows.append(
                {
                    "prompt": f"Summarize this report in two sentences:\n{doc}",
                    "max_tokens": 32,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "kind": "long",
                }
            )
        else:
            prompt = rng.choice(STYLES).format(t=rng.choice(TOPICS))
            rows.append(
                {
                    "prompt": prompt,
                    "max_tokens": heavy_tailed(rng, 48, 0.5, 16, 128),
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "kind": "chat",
                }
            )
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {path} ({len(rows)} requests)")


if __name__ == "__main__":
    here = Path(__file__).parent / "workloads"
    here.mkdir(exist_ok=True)
    write(here / "offline_default.jsonl", offline_default())
    write(here / "serving_default.jsonl", serving_default())
