"""``python -m gpo.envs.number_guess_prompts OUT``: prompts for ``NumberGuess`` in ``OUT/train.jsonl`` and
``OUT/val.jsonl``."""

from __future__ import annotations

import argparse

from gpo.tasks import write_jsonl


def prompt(low: int = 1, high: int = 8) -> str:
    """The instruction every episode starts from."""
    return f"guess {low}-{high}:"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpo.envs.number_guess_prompts", description=__doc__)
    parser.add_argument("out", help="folder to write train.jsonl and val.jsonl into")
    parser.add_argument("--low", type=int, default=1)
    parser.add_argument("--high", type=int, default=8)
    parser.add_argument("--examples", type=int, default=4096)
    args = parser.parse_args(argv)
    # The rows are all the same instruction: each episode's secret comes from its seed, not from the row.
    rows = [{"prompt": prompt(args.low, args.high)}]
    write_jsonl(rows * args.examples, f"{args.out}/train.jsonl")
    write_jsonl(rows * 16, f"{args.out}/val.jsonl")
    print(f"wrote {args.out}/train.jsonl and {args.out}/val.jsonl")


if __name__ == "__main__":
    main()
