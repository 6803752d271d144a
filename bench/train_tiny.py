"""Trains the embedded tiny model and measures it against random weights.

Trains TINY on the standard library (model/training.py) into --out (default: the shipped
model/assets/tiny-trained), then scores on the held-out modules, through the loader:
the trained checkpoint, the same architecture and tokenizer at its random initial
weights, and make_tiny's random default (its own tokenizer: compare bits per byte):
perplexity, bits per byte, DSpark acceptance on each model's own greedy continuations
(model-level ReferenceDrafter.speculative_greedy), and the greedy continuation of the
README's example prompt. Prints a table and writes JSON (default bench/results/train_tiny.json).

Usage: python3 -m bench.train_tiny [--out DIR] [--minutes 12] [--seed 0] [--threads N] [--results PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from tokenizers import Tokenizer

from dsv41.model.loader import TOKENIZER_FILE
from dsv41.model.params import load_model_params
from dsv41.model.reference import ReferenceModel
from dsv41.model.tiny import TINY, TRAINED_TINY_DIR, make_tiny
from dsv41.model.training import Corpus, TrainableModel, heldout_acceptance, heldout_score, train_tiny

README_PROMPT = "hello"
README_MAX_TOKENS = 8
HELDOUT_CHUNKS = 32
ACCEPTANCE_PROMPTS = 8
ACCEPTANCE_PROMPT_TOKENS = 96
ACCEPTANCE_MAX_TOKENS = 32


@torch.no_grad()
def greedy_text(model_dir: Path, prompt: str, max_tokens: int) -> dict:
    """The dense reference's greedy continuation (end of sequence stops it, as it stops a request)."""
    params, checkpoint = load_model_params(model_dir)
    model = ReferenceModel(params)
    ids = checkpoint.tokenizer.encode(prompt).ids
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(model.forward(ids + out).logits[-1].argmax())
        out.append(token)
        if token == params.config.eos_token_id:
            break
    return {"token_ids": out, "text": checkpoint.tokenizer.decode(out, skip_special_tokens=True)}


def score(name: str, model_dir: Path, texts: list[str], *, acceptance: bool) -> dict:
    started = time.monotonic()
    heldout = heldout_score(model_dir, texts, max_chunks=HELDOUT_CHUNKS)
    result: dict = {"model": name, "heldout": {**asdict(heldout), "perplexity": heldout.perplexity}}
    if acceptance:
        result["dspark"] = asdict(
            heldout_acceptance(
                model_dir,
                texts,
                prompts=ACCEPTANCE_PROMPTS,
                prompt_tokens=ACCEPTANCE_PROMPT_TOKENS,
                max_tokens=ACCEPTANCE_MAX_TOKENS,
            )
        )
    result["readme_example"] = greedy_text(model_dir, README_PROMPT, README_MAX_TOKENS)
    result["eval_seconds"] = time.monotonic() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(TRAINED_TINY_DIR))
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--results", default="bench/results/train_tiny.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    started = time.monotonic()
    report = train_tiny(out, minutes=args.minutes, seed=args.seed)
    train_seconds = time.monotonic() - started
    texts = Corpus.texts(Corpus.stdlib().heldout)
    with tempfile.TemporaryDirectory() as scratch:
        initial = TrainableModel.initial(TINY, Tokenizer.from_file(str(out / TOKENIZER_FILE)), args.seed)
        initial_dir = initial.write(Path(scratch) / "initial")
        default_dir = make_tiny(Path(scratch) / "make-tiny")
        scores = [
            score("trained", out, texts, acceptance=True),
            score("random initial weights (same tokenizer)", initial_dir, texts, acceptance=True),
            score("make_tiny random default (its own tokenizer)", default_dir, texts, acceptance=True),
        ]
    checkpoint_bytes = sum(path.stat().st_size for path in out.iterdir() if path.is_file())
    results = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python3 " + " ".join(sys.argv),
        "train_wall_seconds": train_seconds,
        "training": asdict(report),
        "checkpoint_bytes": checkpoint_bytes,
        "scores": scores,
    }
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(results, indent=2) + "\n")
    print(f"trained in {train_seconds:.0f} s: target {report.target.steps} steps ({report.target.tokens} tokens), "
          f"DSpark {report.dspark.steps} steps; checkpoint {checkpoint_bytes / 2**20:.2f} MiB")
    print("| model | held-out ppl | bits/byte | DSpark accepted / 5 | `hello` -> |")
    print("|---|---:|---:|---:|---|")
    for s in scores:
        accepted = f"{s['dspark']['mean_accepted']:.2f}" if "dspark" in s else "-"
        print(f"| {s['model']} | {s['heldout']['perplexity']:.2f} | {s['heldout']['bits_per_byte']:.3f} | {accepted} "
              f"| {s['readme_example']['text']!r} |")


if __name__ == "__main__":
    main()
