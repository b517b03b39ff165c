"""The ``gpo`` command: ``gpo fit --config configs/grpo.yaml`` (LightningCLI) and ``gpo tiny`` (local test assets)."""

from __future__ import annotations

import argparse
import sys

from lightning.pytorch.cli import LightningCLI

from gpo.data import PromptDataModule
from gpo.module import GPOModule


class GPOCLI(LightningCLI):
    """LightningCLI whose data module reads the policy's tokenizer unless told otherwise."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.policy", "data.tokenizer")


def make_tiny(argv: list[str]) -> None:
    """``gpo tiny OUT``: write a tiny random model and a synthetic task's prompts for a CPU run."""
    from gpo.tasks import TASKS, make_task, write_jsonl
    from gpo.testing import save_tiny_model

    parser = argparse.ArgumentParser(prog="gpo tiny", description=make_tiny.__doc__)
    parser.add_argument("out", help="folder to write model/, train.jsonl and val.jsonl into")
    parser.add_argument("--task", default="sort_digits", choices=sorted(TASKS))
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen2_moe"])
    parser.add_argument("--examples", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = save_tiny_model(f"{args.out}/model", args.arch, seed=args.seed)
    write_jsonl(make_task(args.task, args.examples, seed=args.seed), f"{args.out}/train.jsonl")
    write_jsonl(make_task(args.task, 64, seed=args.seed + 1), f"{args.out}/val.jsonl")
    print(f"wrote {model}, {args.out}/train.jsonl and {args.out}/val.jsonl")


def main(argv: list[str] | None = None) -> None:
    """Entry point; ``argv`` defaults to the command line."""
    if (sys.argv[1:] if argv is None else argv)[:1] == ["tiny"]:
        make_tiny((sys.argv[1:] if argv is None else argv)[1:])
        return
    GPOCLI(GPOModule, PromptDataModule, args=argv, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
