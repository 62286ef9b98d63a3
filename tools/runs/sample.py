"""Read what a transformer run learned: continue a prompt with its model.pt.

    python -m tools.runs.sample runs/fsdp2_transformer --prompt "ROMEO:" --tokens 300

The run's final record (metrics.jsonl) holds the model's shape and how its ids turn into text: the
characters of a --text-file, or the bytes of a --token-file (tools.runs.prepare_tokens). The synthetic
Markov tokens are not text, nor is a token file of your own tokenizer to this command: give the
prompt as ids ("3 14 15") and read ids back. One process, on the CPU unless --device cuda; the
model is rebuilt whole, as model.pt holds it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from common.flags import float_in_range, positive_int, seed_value
from common.models import GPT, GPTConfig
from common.run_dir import METRICS_FILE, MODEL_FILE
from tools.command_flags import existing_dir
from tools.records import read_records


def final_record(run_dir: Path) -> dict[str, Any] | None:
    """The run's final record; None without one. A line that is no record raises ValueError, saying where."""
    if not (run_dir / METRICS_FILE).is_file():
        return None
    return read_records(run_dir).final


def encode(prompt: str, decoding: dict[str, Any], vocab_size: int) -> list[int]:
    """The prompt's ids; ValueError names what the run's vocabulary cannot say."""
    if "characters" in decoding:
        unknown = sorted(set(prompt) - set(decoding["characters"]))
        if unknown:
            raise ValueError(f"characters the training text never had: {''.join(unknown)!r}")
        return [decoding["characters"].index(char) for char in prompt]
    if decoding.get("tokenizer") == "bytes":
        ids = list(prompt.encode("utf-8"))
    else:  # synthetic tokens, or a tokenizer of the user's own: this command knows only its ids
        ids = [read_id(word) for word in prompt.split()]
    outside = sorted({token for token in ids if token >= vocab_size})
    if outside:
        raise ValueError(
            f"ids {outside[:5]} are outside the model's vocabulary of {vocab_size} (0 to {vocab_size - 1})"
        )
    return ids


def read_id(word: str) -> int:
    if not (word.isascii() and word.isdigit()):
        raise ValueError(
            f"{word!r} is not a token id (a whole number, 0 or more); give the prompt as ids, e.g. '3 14 15'"
        )
    return int(word)


def decode(ids: list[int], decoding: dict[str, Any]) -> str:
    """Text, where the run says how to make it; else the ids, one space between each."""
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


# Below 0.01 the draw is the likeliest token anyway, and logits / temperature leave float32's range
# (1e-40 gave nan probabilities); above 100 it is a uniform draw.
temperature = float_in_range(0.01, 100, name="temperature")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.runs.sample", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=existing_dir, help="a finished transformer run: its metrics.jsonl and model.pt")
    parser.add_argument("--prompt", required=True, help="the text to continue (ids, for synthetic tokens)")
    parser.add_argument(
        "--tokens", type=positive_int, default=200, help="how many tokens to add (default: %(default)s)"
    )
    parser.add_argument(
        "--temperature", type=temperature, default=1.0, help="0.01 to 100; below 1: likelier tokens (default: 1)"
    )
    parser.add_argument("--seed", type=seed_value, default=0, help="the draws' seed (default: %(default)s)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs (default: cpu)")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what cannot be sampled before the model is loaded; fill in args.final, args.decoding and args.ids."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    try:
        args.final = final_record(args.run_dir)
    except ValueError as err:
        parser.error(str(err))
    config = (args.final or {}).get("model_config")
    if not isinstance(config, dict) or not (args.run_dir / MODEL_FILE).is_file():
        parser.error(f"{args.run_dir} holds no finished transformer run (a final record with model_config, model.pt)")
    vocab_size = config.get("vocab_size")
    decoding = args.final.get("decoding")
    args.decoding = decoding if isinstance(decoding, dict) else {}
    if not isinstance(vocab_size, int) or vocab_size < 1:
        parser.error(f"{args.run_dir}/metrics.jsonl: its model_config has no vocab_size the model could have")
    try:
        args.ids = encode(args.prompt, args.decoding, vocab_size)
    except ValueError as err:
        parser.error(f"--prompt: {err}")
    if not args.ids:
        parser.error("--prompt is empty")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def load_model(parser: argparse.ArgumentParser, run_dir: Path, final: dict[str, Any]) -> GPT:
    try:
        model = GPT(GPTConfig(**final["model_config"]), seed=None)
        model.load_state_dict(torch.load(run_dir / MODEL_FILE, map_location="cpu", weights_only=True))
    except Exception as err:  # noqa: BLE001 - a model.pt that does not fit its record, or no model at all
        said = " ".join(str(err).split()) or type(err).__name__  # one line: load_state_dict lists each tensor
        parser.error(f"{run_dir}/model.pt does not load as the model its metrics.jsonl describes: {said[:300]}")
    return model


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    model = load_model(parser, args.run_dir, args.final).to(args.device).eval()
    generator = torch.Generator().manual_seed(args.seed)
    continuation = continue_prompt(model, args.ids, args.tokens, args.temperature, generator)
    # Decoded as one sequence: ids need a space between prompt and continuation, and a UTF-8
    # character may start in the prompt and end in the continuation.
    print(decode(args.ids + continuation, args.decoding))
    return 0


if __name__ == "__main__":
    sys.exit(main())
