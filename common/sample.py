"""Read what a transformer run learned: continue a prompt with its model.pt.

    python -m common.sample runs/fsdp2_transformer --prompt "ROMEO:" --tokens 300

The run's final record (metrics.jsonl) holds the model's shape and how its ids turn into text: the
characters of a --text-file, or the bytes of a --token-file (common.prepare_tokens). The synthetic
Markov tokens are not text: give the prompt as ids ("3 14 15") and read ids back. One process, on
the CPU unless --device cuda; the model is rebuilt whole, as model.pt holds it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from common.compare_runs import read_records
from common.models import GPT, GPTConfig


def final_record(run_dir: Path) -> dict[str, Any] | None:
    """The run's last final record; None without one. A line cut short raises ValueError, saying where."""
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    finals = [record for record in read_records(run_dir) if record["event"] == "final"]
    return finals[-1] if finals else None


def encode(prompt: str, decoding: dict[str, Any]) -> list[int]:
    """The prompt's ids; ValueError names what the run's vocabulary cannot say."""
    if "characters" in decoding:
        unknown = sorted(set(prompt) - set(decoding["characters"]))
        if unknown:
            raise ValueError(f"characters the training text never had: {''.join(unknown)!r}")
        return [decoding["characters"].index(char) for char in prompt]
    if decoding.get("tokenizer") == "bytes":
        return list(prompt.encode("utf-8"))
    if decoding:
        raise ValueError(f"tokenizer {decoding.get('tokenizer')!r}: give the prompt as ids, and decode them yourself")
    return [int(token) for token in prompt.split()]


def decode(ids: list[int], decoding: dict[str, Any]) -> str:
    if "characters" in decoding:
        return "".join(decoding["characters"][i] for i in ids)
    if decoding.get("tokenizer") == "bytes":
        return bytes(ids).decode("utf-8", errors="replace")  # a cut multi-byte character shows as U+FFFD
    return " ".join(map(str, ids))


@torch.no_grad()
def continue_prompt(
    model: GPT, ids: list[int], tokens: int, temperature: float, generator: torch.Generator
) -> list[int]:
    """``tokens`` more ids, each drawn from the model's distribution given at most block_size before it."""
    device = next(model.parameters()).device
    sequence = torch.tensor(ids, dtype=torch.long, device=device)
    for _ in range(tokens):
        logits = model(sequence[-model.config.block_size :][None])[0, -1].float()
        probabilities = torch.softmax(logits / temperature, dim=-1).cpu()
        following = torch.multinomial(probabilities, 1, generator=generator).to(device)
        sequence = torch.cat([sequence, following])
    return sequence[len(ids) :].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished transformer run: its metrics.jsonl and model.pt")
    parser.add_argument("--prompt", required=True, help="the text to continue (ids, for synthetic tokens)")
    parser.add_argument("--tokens", type=int, default=200, help="how many tokens to add (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0, help="below 1: likelier tokens (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="the draws' seed (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.temperature <= 0:
        parser.error("--tokens must be 1 or more and --temperature above 0")
    try:
        final = final_record(args.run_dir)
    except ValueError as err:
        parser.error(str(err))
    if final is None or "model_config" not in final or not (args.run_dir / "model.pt").is_file():
        parser.error(f"{args.run_dir} holds no finished transformer run (a final record with model_config, model.pt)")
    decoding = final.get("decoding", {})
    try:
        ids = encode(args.prompt, decoding)
    except ValueError as err:
        parser.error(f"--prompt: {err}")
    if not ids:
        parser.error("--prompt is empty")
    model = GPT(GPTConfig(**final["model_config"]), seed=None)
    model.load_state_dict(torch.load(args.run_dir / "model.pt", map_location="cpu", weights_only=True))
    model.to(args.device).eval()
    generator = torch.Generator().manual_seed(args.seed)
    continuation = continue_prompt(model, ids, args.tokens, args.temperature, generator)
    print(decode(ids, decoding) + decode(continuation, decoding))
    return 0


if __name__ == "__main__":
    sys.exit(main())
