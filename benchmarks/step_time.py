"""Step time of ``GPOModule`` against a bare loop doing the same generate + forward/backward/optimiser work.

Two workloads (``--preset``; every size is also a flag): ``quickstart``, the CPU quickstart's model and lengths (a
tiny random llama of hidden 64 and 2 layers, 8 prompts x 8 completions of up to 4 tokens, where
``configs/quickstart.yaml`` samples 16 per prompt; lr 1e-3), where a step is tens of
milliseconds and any fixed per-step cost shows; and ``long`` (hidden 256, 4 layers, 32 tokens), where a step is
most of a second. Both: a character vocabulary, ``sort_digits`` prompts, temperature 1 (no top-p/top-k), the
``grpo`` preset with one optimiser step per rollout batch and old log-probs recomputed by the trainer
(``old_logprobs="trainer"``: on-policy, the current ones detached), AdamW, float32, the ``positional_match``
reward. A Lightning ``Trainer`` runs ``warmup + steps`` steps with the default loggers of ``gpo fit`` (CSV and
TensorBoard, ``--log-every-n-steps``; ``--loggers none`` turns them off), no checkpoints and no progress bar; the
``steps`` after the warm-up are measured. Both sides run on the CPU, or on a CUDA GPU with ``--accelerator cuda``;
there every timer first waits for the work queued on the GPU (``torch.cuda.synchronize``), on both sides.

Measured per step:

* ``rollout``, ``scoring``, ``training``: the split ``GPOModule`` logs itself (``time/rollout_s``, ...).
  Inside the rollout, ``generate`` and the sampler's log-prob pass (run only when the trainer reads rollout
  log-probs; not in this workload) are timed separately by wrapping the ``HFEngine`` instance's sampling method
  and its scorer.
* ``step``: wall time from the end of one training batch to the end of the next, so Lightning's loop, data
  loading and logging are included.
* the profile: ``generate``, the sampler's log-prob pass, forward + loss (``Learner._micro_loss``), backward
  (``manual_backward``), optimiser (gradient clipping + ``AdamW.step``), logging (``gpo.train.metrics.publish_step``:
  the step's metrics computed, reduced and handed to the loggers, callbacks and progress bar), gpo's bookkeeping (the
  rest of ``training_step``: hooks, decoding, rewards, advantages) and the loop
  (the step's wall time outside ``training_step``), each timed by wrapping that function.
* rollout tokens/s: generated completion tokens (up to and including EOS) per second of rollout time.
* training tokens/s: prompt + completion tokens (attention-mask ones) per second of training time.

The bare work runs on a fresh copy of the initial model, outside gpo and Lightning, right after each gpo step
(outside that step's timed interval, so both see the same machine load): one ``model.generate(...)`` on the step's
prompts (already repeated ``group_size`` times) with the same sampling settings, in eval mode from a seed, plus one
``model(input_ids, attention_mask, position_ids).logits -> log_softmax -> gather -> loss -> backward -> clip the
gradient norm at 1.0 -> fused AdamW step`` in train mode on the exact token tensors gpo trained on: the work gpo's
settings ask for (the positions are those ``generate`` sampled at, which skip left padding). Its warm-up is gpo's
warm-up steps. The ``generate`` call takes two forms on alternate steps: hand-written (sampling settings as keyword
arguments, ``torch.manual_seed``) and as gpo's engine makes it (a generation config built once, the sampling
device's generator seeded directly, in inference mode); the overhead, gpo step time / (bare generate + bare train),
is reported against each over its own steps. Between the two, the bare work also does what any GRPO step does
besides: it left-pads the batch's prompt token lists into tensors, marks the completion tokens up to the first EOS,
decodes gpo's completions, scores them with ``positional_match`` and normalises the rewards within each group, whose
advantages its loss uses: the overhead against that complete bare GRPO step (``generate`` as gpo calls it) is
reported too.

Run from the repository root (1 torch thread by default; keep the other cores idle while it runs)::

    python benchmarks/step_time.py --preset quickstart --steps 200
    python benchmarks/step_time.py --preset long
    python benchmarks/step_time.py --profile 25   # cProfile of the measured gpo steps instead (no timings table)
    python benchmarks/step_time.py --op-sites 30  # gpo's tensor operations by the function that issues them
    python benchmarks/step_time.py --preset quickstart --stand-ins advantages scoring logging  # bare stand-ins
    python benchmarks/step_time.py --preset quickstart --with-callbacks  # DifficultyFilter and RolloutMonitor on
    python benchmarks/step_time.py --preset quickstart --accelerator cuda  # both sides on the GPU

See ``--help`` for the sizes, steps and threads.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import logging
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import lightning as L
import torch
import transformers
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import gpo from this checkout
from workload import add_preset_argument, add_workload_arguments, device_clock, mean_sd  # benchmarks/workload.py

import gpo.parallel.collectives
import gpo.parallel.fsdp
import gpo.train.module
from gpo.callbacks import DifficultyFilter, RolloutMonitor
from gpo.cli import default_loggers
from gpo.rewards import positional_match
from gpo.rollout import HFEngine, Sampling
from gpo.rollout.base import Rollout
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.hooks import RolloutCallback
from gpo.train.module import GPOModule
from gpo.train.optimization import Optimization

PROFILED = ("generate", "sampler_logp", "forward", "backward", "optimiser", "logging", "inside")
STAND_INS = ("advantages", "scoring", "logging")


@dataclass
class Step:
    """One training step: gpo's timings and the token tensors it generated and trained on."""

    wall_s: float
    rollout_s: float
    scoring_s: float
    training_s: float
    generate_s: float
    sampler_logp_s: float
    forward_s: float
    backward_s: float
    optimiser_s: float
    logging_s: float
    inside_s: float  # the whole training_step
    prompt_ids: Tensor  # [B, P]
    prompt_mask: Tensor  # [B, P]
    completion_ids: Tensor  # [B, T]
    completion_mask: Tensor  # [B, T]
    prompts: list[str]  # [B]
    answers: list[str]  # [B]
    prompt_lists: list[list[int]]  # the batch's prompts as token lists, one per group, as the data loader gives them
    bare_generate_s: float = float("nan")
    bare_lean: bool = False  # the bare generate call was made as gpo makes it (BareWork.generate_lean)
    bare_forward_s: float = float("nan")  # forward + loss
    bare_backward_s: float = float("nan")
    bare_optimiser_s: float = float("nan")  # clip + AdamW step + zero_grad
    bare_scoring_s: float = float("nan")  # padding + completion mask + decode + reward + group advantages
    bare_width: int = 0

    @property
    def bare_train_s(self) -> float:
        return self.bare_forward_s + self.bare_backward_s + self.bare_optimiser_s

    @property
    def generated_tokens(self) -> int:
        return int(self.completion_mask.sum())

    @property
    def train_inputs(self) -> tuple[Tensor, Tensor, int]:
        """``ids``, ``attention_mask`` and completion width exactly as ``Learner._micro_loss`` builds them."""
        width = int(self.completion_mask.sum(-1).max().clamp_min(1))
        ids = torch.cat([self.prompt_ids, self.completion_ids[:, :width]], 1)
        mask = torch.cat([self.prompt_mask, self.completion_mask[:, :width]], 1)
        return ids, mask, width

    @property
    def train_tokens(self) -> int:
        return int(self.train_inputs[1].sum())


class BareWork:
    """The same work without gpo or Lightning, on a fresh copy of the initial model."""

    def __init__(self, model_path: str, args: argparse.Namespace, device: torch.device) -> None:
        self.device, self.clock = device, device_clock(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, fused=True)  # as gpo builds it
        self.group_size = args.group_size
        self.sampling = {
            "max_new_tokens": args.max_new_tokens, "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "eos_token_id": self.tokenizer.eos_token_id, "pad_token_id": self.tokenizer.pad_token_id,
        }  # fmt: skip
        self.generation_config = copy.deepcopy(self.model.generation_config)
        self.generation_config.update(**self.sampling)

    def generate(self, step: Step, seed: int) -> tuple[float, int]:
        """One ``generate`` call on the step's prompts (already ``group_size`` rows each), in eval mode from a seed,
        written as a hand-made loop usually is: sampling settings as keyword arguments (transformers builds and
        validates a generation config from them on every call) and ``torch.manual_seed``. Seconds, decode steps."""
        return self._generate(step, lambda: torch.manual_seed(seed), **self.sampling)

    def generate_lean(self, step: Step, seed: int) -> tuple[float, int]:
        """The same call as gpo's engine makes it: a generation config built once, the sampling device's generator
        seeded directly (``torch.manual_seed`` also queues the seeding of devices that are not in use), in inference
        mode."""
        generator = torch.random.default_generator if self.device.type == "cpu" else torch.cuda.default_generators[0]
        seeding = lambda: generator.manual_seed(seed)  # noqa: E731
        with torch.inference_mode():
            return self._generate(step, seeding, generation_config=self.generation_config)

    def _generate(self, step: Step, seeding: Callable[[], object], **settings: Any) -> tuple[float, int]:
        started = self.clock()
        self.model.eval()
        seeding()
        out = self.model.generate(input_ids=step.prompt_ids, attention_mask=step.prompt_mask, **settings)
        return self.clock() - started, out.shape[1] - step.prompt_ids.shape[1]

    def score(self, step: Step) -> tuple[float, Tensor]:
        """What any GRPO step does around sampling besides ``generate`` and training: left-pad the batch's token
        lists into the ``[B, P]`` tensors ``generate`` takes (``--group-size`` rows each), mark the completion tokens
        up to and including the first EOS, decode the completions (gpo's tokens), score them with the same reward
        function, and normalise the rewards within each group (GRPO's population standard deviation; a group
        without spread gets 0). The tensors are checked against the ones gpo built, outside the timer. Seconds,
        advantages ``[B, 1]``."""
        started = self.clock()
        pad, eos, n = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, self.group_size
        lists = step.prompt_lists
        width = max(map(len, lists))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in lists]).repeat_interleave(n, 0).to(self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in lists]).repeat_interleave(n, 0)
        mask = mask.to(self.device)
        is_eos = (step.completion_ids == eos).long()
        completion_mask = (is_eos.cumsum(1) - is_eos) == 0  # [B, T]: no EOS before this token
        completions = self.tokenizer.batch_decode(step.completion_ids.masked_fill(~completion_mask, pad),
                                                  skip_special_tokens=True)  # fmt: skip
        rewards = torch.tensor(positional_match(step.prompts, completions, answer=step.answers), device=self.device)
        advantages = group_advantages(rewards, self.group_size)
        elapsed = self.clock() - started
        same = torch.equal(ids, step.prompt_ids) and torch.equal(mask, step.prompt_mask)
        if not (same and torch.equal(completion_mask.long(), step.completion_mask)):
            raise AssertionError("the bare padding or completion mask differs from gpo's: not the same work")
        return elapsed, advantages

    def train(self, step: Step, advantages: Tensor) -> tuple[float, float, float]:
        """Forward (at the positions ``generate`` sampled at, as any trainer must pass with left-padded prompts),
        log-softmax, gather, GRPO's policy-gradient loss (sequence means of the tokens, averaged), backward, gradient
        clipping at gpo's ``max_grad_norm`` (1.0) and an AdamW step on gpo's tensors, in train mode. Seconds of
        forward + loss, backward and optimiser."""
        started = self.clock()
        ids, mask, width = step.train_inputs  # built in the timed forward, as gpo builds its own
        targets, weights = ids[:, -width:], mask[:, -width:].float()
        self.model.train()
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # generate's positions: left padding skipped
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -width - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
        loss = -((logp * advantages * weights).sum(-1) / weights.sum(-1).clamp_min(1)).mean()
        forward_end = self.clock()
        loss.backward()
        backward_end = self.clock()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        end = self.clock()
        return forward_end - started, backward_end - forward_end, end - backward_end


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """GRPO's advantages of ``rewards[B]``, whose rows come in groups of ``group_size`` in order, as a reshape:
    ``(r - mean) / std`` within each group (population std; a group without spread gets 0). ``[B, 1]``."""
    grouped = rewards.view(-1, group_size)  # [prompts, group]
    std = grouped.std(-1, unbiased=False, keepdim=True)
    normalised = (grouped - grouped.mean(-1, keepdim=True)) / std.clamp_min(1e-6)
    return torch.where(std > 1e-6, normalised, 0.0).view(-1, 1)


class StepRecorder(RolloutCallback):
    """Collects a ``Step`` per training batch and, between gpo's steps, replays it with the bare work.

    Interleaving puts gpo and the bare work under the same machine load. With a ``profiler`` (cProfile, or
    ``OpSites``) the steps after the warm-up run under it instead (and no bare work is done).
    """

    def __init__(
        self, engine: HFEngine, bare: BareWork | None, warmup: int, seed: int,
        profiler: cProfile.Profile | OpSites | None, stand_ins: list[str], clock: Callable[[], float],
    ) -> None:  # fmt: skip
        self.steps: list[Step] = []
        self.clock = clock
        self.stand_ins = stand_ins
        self.bare, self.warmup, self.seed = bare, warmup, seed
        self.profiler = profiler
        self.last_end: float | None = None
        self.rollout = None
        self.engine = engine
        self.times = dict.fromkeys(PROFILED, 0.0)
        engine._sample = self._timed(engine._sample, "generate")

    def _timed(self, fn, key):
        def wrapper(*args, **kwargs):
            started = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[key] += self.clock() - started

        return wrapper

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        put_stand_ins(pl_module, self.stand_ins)
        # Each wrapped at the place gpo looks it up, so gpo's code runs unchanged inside the timers.
        scorer = self.engine.scorer  # the engine's own, built at setup: it scores only the sampler's log-probs
        scorer.policy_logp = self._timed(scorer.policy_logp, "sampler_logp")
        learner = pl_module.learner
        learner._micro_loss = self._timed(learner._micro_loss, "forward")
        pl_module.manual_backward = self._timed(pl_module.manual_backward, "backward")
        optimizer = pl_module.optimizers().optimizer
        optimizer.step = self._timed(optimizer.step, "optimiser")
        gpo.parallel.fsdp.clip_grad_norm = self._timed(gpo.parallel.fsdp.clip_grad_norm, "optimiser")
        gpo.train.module.publish_step = self._timed(gpo.train.module.publish_step, "logging")
        pl_module.training_step = self._timed(pl_module.training_step, "inside")

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.times = dict.fromkeys(self.times, 0.0)
        if self.profiler is not None and batch_idx == self.warmup:
            self.profiler.enable()

    @override
    def on_rollout_end(self, trainer, pl_module, rollout) -> None:  # called by GPOModule after scoring
        self.rollout = rollout

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = self.clock()
        logged, r, g = trainer.callback_metrics, self.rollout, pl_module.collector.group_size
        step = Step(
            wall_s=now - self.last_end if self.last_end is not None else float("nan"),
            rollout_s=float(logged["time/rollout_s"]),
            scoring_s=float(logged["time/scoring_s"]),
            training_s=float(logged["time/training_s"]),
            generate_s=self.times["generate"],
            sampler_logp_s=self.times["sampler_logp"],
            forward_s=self.times["forward"],
            backward_s=self.times["backward"],
            optimiser_s=self.times["optimiser"],
            logging_s=self.times["logging"],
            inside_s=self.times["inside"],
            prompt_ids=r.prompt_ids.clone(),
            prompt_mask=r.prompt_mask.clone(),
            completion_ids=r.completion_ids.clone(),
            completion_mask=r.completion_mask.clone(),
            prompts=list(r.prompts),
            answers=list(r.fields["answer"]),
            prompt_lists=[
                row[keep.bool()].tolist() for row, keep in zip(r.prompt_ids[::g], r.prompt_mask[::g], strict=True)
            ],
        )
        if self.bare is not None:
            step.bare_lean = bool(batch_idx % 2)  # the two forms of the bare generate call take turns
            generate = self.bare.generate_lean if step.bare_lean else self.bare.generate
            step.bare_generate_s, step.bare_width = generate(step, self.seed + batch_idx)
            step.bare_scoring_s, advantages = self.bare.score(step)
            step.bare_forward_s, step.bare_backward_s, step.bare_optimiser_s = self.bare.train(step, advantages)
        self.steps.append(step)
        if self.profiler is not None and trainer.global_step >= trainer.max_steps:
            self.profiler.disable()  # the last measured step is done (global_step counts optimiser steps)
        self.last_end = self.clock()  # the bookkeeping above is ours, not gpo's: start the next step here


def monitoring_callbacks(attach: bool) -> list[L.Callback]:
    """``DifficultyFilter`` with the band ``[0, 1]`` (every prompt admitted, its bookkeeping done) and
    ``RolloutMonitor``: callbacks that change nothing gpo trains on; none unless ``attach``."""
    return [DifficultyFilter(low=0.0, high=1.0), RolloutMonitor()] if attach else []


def put_stand_ins(module: GPOModule, parts: list[str]) -> None:
    """Replace ``parts`` of gpo's step by bare stand-ins, to bound what trimming them could save: ``advantages``,
    GRPO's group normalisation as a reshape (the rows come in groups, in order); ``scoring``, the reward function
    called directly (no runner: no checks, no error policy); ``logging``, no step metrics, only the step-time split
    this benchmark reads."""
    group_size = module.collector.group_size
    if "advantages" in parts:

        def credit(rollout: Rollout, mask: Tensor) -> tuple[dict[str, Tensor], Tensor, Tensor]:
            adv = group_advantages(rollout.reward, group_size) * mask  # [B, T]
            step, _ = gpo.parallel.collectives.gather_step(rollout, mask)  # one process: this rank's rows as they are
            return step, adv, adv

        module.credit = credit
    if "scoring" in parts:

        def score(rollout: Rollout, errors: object) -> Rollout:
            rewards = positional_match(rollout.prompts, rollout.completions, **rollout.fields)
            rollout.reward = torch.tensor(rewards, device=rollout.completion_ids.device)
            rollout.scores = rollout.reward[:, None]
            return rollout

        module.collector.score = score
    if "logging" in parts:

        def publish_step(trainer, collector, rollout, step, step_adv, metrics, *, scoring_s, training_s) -> None:
            seconds = {"rollout_s": collector.stats.rollout_s, "scoring_s": scoring_s, "training_s": training_s}
            trainer.callback_metrics.update({f"time/{key}": torch.tensor(value) for key, value in seconds.items()})

        gpo.train.module.publish_step = publish_step


def make_workspace(root: Path, args: argparse.Namespace) -> tuple[str, str]:
    model = save_tiny_model(root / "model", "llama", seed=0, hidden_size=args.hidden_size, num_layers=args.num_layers)
    data = write_jsonl(make_task("sort_digits", 4096, seed=0), root / "train.jsonl")
    return str(model), str(data)


def run_gpo(model_path: str, data_path: str, root: Path, args: argparse.Namespace) -> list[Step]:
    """``warmup + steps`` GPOModule training steps; returns the measured ones."""
    L.seed_everything(args.seed, verbose=False)
    engine = HFEngine(sampling=Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens))
    module = GPOModule(
        model_path,
        [positional_match],
        algorithm="grpo",
        engine=engine,
        group_size=args.group_size,
        optim=Optimization(lr=args.lr),
        old_logprobs="trainer",  # on-policy: old log-probs = the current ones, detached (as TRL does)
        seed=args.seed,
    )
    device = torch.device(args.accelerator)
    profiler = cProfile.Profile() if args.profile is not None else OpSites() if args.op_sites is not None else None
    bare = None if profiler is not None else BareWork(model_path, args, device)
    recorder = StepRecorder(engine, bare, args.warmup, args.seed, profiler, args.stand_ins, device_clock(device))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        default_root_dir=root,  # anything the module writes at the end stays in the temporary folder
        max_steps=args.warmup + args.steps,  # one optimiser step per rollout batch here
        logger=default_loggers(str(root)) if args.loggers == "default" else False,
        log_every_n_steps=args.log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*monitoring_callbacks(args.with_callbacks), recorder],
    )
    trainer.fit(module, PromptDataModule(data_path, tokenizer=model_path, prompts_per_step=args.prompts_per_step))
    if isinstance(profiler, cProfile.Profile):
        print_profile(profiler, args.profile)
    elif profiler is not None:
        profiler.print(args.op_sites, steps=args.steps)
    return recorder.steps[args.warmup :]


class OpSites(TorchDispatchMode):
    """Counts the tensor operations of the measured steps, and the host time each takes to run (on a GPU: to be
    checked, dispatched and launched), by what issued it: the innermost frame in ``gpo/`` or ``callbacks/``, or, for
    operations run inside transformers (the model, ``generate``), the autograd engine (backward) or ``torch.optim``,
    that. Views (operations whose result aliases an input without writing it) are left out: they launch no kernel.
    The dispatch hook's own cost is not in the times, but it slows the steps it watches."""

    GROUPS = (("/transformers/", "the model and generate (transformers)"), ("/torch/autograd/", "backward"),
              ("/torch/optim/", "optimiser (torch.optim)"))  # fmt: skip
    ELSEWHERE = "elsewhere (Lightning, this benchmark)"

    def __init__(self) -> None:
        super().__init__()
        self.count, self.seconds = Counter(), Counter()

    def enable(self) -> None:
        self.__enter__()

    def disable(self) -> None:
        self.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        started = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - started
        returned = func._schema.returns
        if not (returned and returned[0].alias_info is not None and not returned[0].alias_info.is_write):
            site = self.site()
            self.count[site] += 1
            self.seconds[site] += elapsed
        return out

    def site(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            for part, group in self.GROUPS:
                if part in name:
                    return group
            if "/gpo/" in name or "/callbacks/" in name:
                return f"{name.rsplit('/gpo/', 1)[-1].rsplit('/callbacks/', 1)[-1]}:{frame.f_code.co_name}"
            frame = frame.f_back
        return self.ELSEWHERE

    def print(self, top: int, steps: int) -> None:
        """The groups, the ``top`` gpo sites with the most operations and gpo's total, per step over ``steps``."""
        others = {group for _, group in self.GROUPS} | {self.ELSEWHERE}
        own = Counter({site: n for site, n in self.count.items() if site not in others})
        shown = [site for site in self.count if site not in own] + [site for site, _ in own.most_common(top)]
        print(f"\n## Tensor operations by call site, per step (mean of {steps}; views left out)\n")
        print("| issued by | operations | host ms |\n| --- | ---: | ---: |")
        for site in sorted(shown, key=self.count.__getitem__, reverse=True):
            print(f"| {site} | {self.count[site] / steps:.1f} | {self.seconds[site] / steps * 1e3:.3f} |")
        ops, seconds = sum(own.values()) / steps, sum(self.seconds[site] for site in own) / steps
        print(f"| **gpo's own, all {len(own)} sites** | **{ops:.1f}** | **{seconds * 1e3:.3f}** |")


def print_profile(profiler: cProfile.Profile, top: int) -> None:
    """The ``top`` entries by cumulative and by own time, as Markdown code blocks."""
    for order in ("cumulative", "tottime"):
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).strip_dirs().sort_stats(order).print_stats(top)
        print(f"\n## cProfile of the measured gpo steps, top {top} by {order}\n\n```")
        print("\n".join(line for line in buffer.getvalue().splitlines() if line.strip()))
        print("```")


def report(steps: list[Step]) -> None:
    """Print the time split, the overhead, the throughputs and the token counts as Markdown."""
    mean = statistics.mean
    wall = [s.wall_s for s in steps]
    bare_gen, bare_train = [s.bare_generate_s for s in steps], [s.bare_train_s for s in steps]
    forms = {  # the steps whose bare work called generate each way (they take turns)
        "hand-written": [s for s in steps if not s.bare_lean],
        "as gpo calls it": [s for s in steps if s.bare_lean],
    }
    rows = [
        ("rollout", [s.rollout_s for s in steps], lambda s: s.bare_generate_s),
        ("- of which `generate`", [s.generate_s for s in steps], lambda s: s.bare_generate_s),
        ("- of which the sampler log-prob pass", [s.sampler_logp_s for s in steps], None),
        ("- of which the rest (padding, decoding)", [s.rollout_s - s.generate_s - s.sampler_logp_s for s in steps],
         None),
        ("scoring", [s.scoring_s for s in steps], lambda s: s.bare_scoring_s),
        ("training", [s.training_s for s in steps], lambda s: s.bare_train_s),
        ("outside training_step (loop, data)", [s.wall_s - s.rollout_s - s.scoring_s - s.training_s for s in steps],
         None),
        ("**step (wall)**", wall, lambda s: s.bare_generate_s + s.bare_train_s),
    ]  # fmt: skip
    print("\n## Time per step (ms, mean ± sd over the measured steps)\n")
    print("The bare work calls `generate` in two forms, on alternate steps: hand-written (sampling settings as keyword")
    print("arguments, `torch.manual_seed`) and as gpo's engine calls it (a generation config built once, the CPU")
    print("generator seeded directly, in inference mode).\n")
    print("| phase | gpo | bare, `generate` hand-written | bare, `generate` as gpo calls it |")
    print("| --- | ---: | ---: | ---: |")
    for name, ours, theirs in rows:
        bare = [mean_sd([theirs(s) * 1e3 for s in chosen]) if theirs else "-" for chosen in forms.values()]
        print(f"| {name} | {mean_sd([v * 1e3 for v in ours])} | {bare[0]} | {bare[1]} |")
    print("\n## Where a step goes (mean ± sd, ms)\n")
    print("The bare column times the same parts of the bare work (`generate` as gpo calls it, its mode switches")
    print("included, which gpo counts in its bookkeeping; against the bookkeeping, the bare padding of the prompts'")
    print("token lists, completion mask, decoding, reward and group advantages).\n")
    print("| part | gpo | share of gpo's step | bare |")
    print("| --- | ---: | ---: | ---: |")
    counted = ("generate_s", "sampler_logp_s", "forward_s", "backward_s", "optimiser_s", "logging_s")
    lean = forms["as gpo calls it"]
    parts = [
        ("generate", [s.generate_s for s in steps], [s.bare_generate_s for s in lean]),
        ("sampler log-prob pass", [s.sampler_logp_s for s in steps], None),
        ("forward + loss", [s.forward_s for s in steps], [s.bare_forward_s for s in steps]),
        ("backward", [s.backward_s for s in steps], [s.bare_backward_s for s in steps]),
        ("optimiser (clip + AdamW step)", [s.optimiser_s for s in steps], [s.bare_optimiser_s for s in steps]),
        ("logging (step metrics computed and handed on)", [s.logging_s for s in steps], None),
        ("gpo bookkeeping (rest of training_step)", [s.inside_s - sum(getattr(s, k) for k in counted) for s in steps],
         [s.bare_scoring_s for s in steps]),
        ("Lightning loop (outside training_step)", [s.wall_s - s.inside_s for s in steps], None),
    ]  # fmt: skip
    for name, values, bare in parts:
        millis = [v * 1e3 for v in values]
        theirs = mean_sd([v * 1e3 for v in bare]) if bare else "-"
        print(f"| {name} | {mean_sd(millis)} | {mean(values) / mean(wall):.1%} | {theirs} |")
    print("\n## Overhead: gpo step / bare step, over the steps of each form\n")
    print("| bare step | gpo / bare (means) | median of the per-step ratios |")
    print("| --- | ---: | ---: |")
    bare_steps = [
        ("`generate` hand-written + train", forms["hand-written"], lambda s: s.bare_generate_s + s.bare_train_s),
        ("`generate` as gpo calls it + train", lean, lambda s: s.bare_generate_s + s.bare_train_s),
        ("`generate` as gpo calls it + padding, masks, decoding, reward, group advantages + train", lean,
         lambda s: s.bare_generate_s + s.bare_scoring_s + s.bare_train_s),
    ]  # fmt: skip
    for name, chosen, bare_s in bare_steps:
        ours, bare = [s.wall_s for s in chosen], [bare_s(s) for s in chosen]
        per_step = statistics.median(w / b for w, b in zip(ours, bare, strict=True))
        print(f"| {name} | **{mean(ours) / mean(bare):.2f}x** | {per_step:.2f}x |")

    gen_tokens, train_tokens = sum(s.generated_tokens for s in steps), sum(s.train_tokens for s in steps)
    rollout_s, training_s = sum(s.rollout_s for s in steps), sum(s.training_s for s in steps)
    print("\n## Throughput\n")
    print("| metric | gpo | bare |")
    print("| --- | ---: | ---: |")
    print(f"| rollout tokens/s (generated) | {gen_tokens / rollout_s:,.0f} | {gen_tokens / sum(bare_gen):,.0f} |")
    print(f"| training tokens/s (prompt + completion) | {train_tokens / training_s:,.0f} | ", end="")
    print(f"{train_tokens / sum(bare_train):,.0f} |")

    print("\n## Tokens per step (mean)\n")
    print("| quantity | gpo | bare |")
    print("| --- | ---: | ---: |")
    print(f"| completions | {steps[0].completion_ids.shape[0]} | {steps[0].prompt_ids.shape[0]} |")
    widths = [s.completion_ids.shape[1] for s in steps]
    print(f"| decode steps (generated width) | {mean(widths):.1f} | {mean(s.bare_width for s in steps):.1f} |")
    print(f"| generated tokens (up to EOS) | {gen_tokens / len(steps):.0f} | - |")
    print(f"| training tokens (prompt + completion) | {train_tokens / len(steps):.0f} | the same tensors |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument(
        "--profile", type=int, metavar="TOP", help="print cProfile's TOP entries for the measured gpo steps instead"
    )
    parser.add_argument(
        "--op-sites", type=int, metavar="TOP",
        help="count the measured gpo steps' tensor operations by the gpo function that issues them (TOP of them) "
        "instead",
    )  # fmt: skip
    add_preset_argument(parser)
    parser.add_argument("--loggers", choices=["default", "none"], default="default", help="CSV + TensorBoard, or none")
    parser.add_argument(
        "--stand-ins", nargs="*", choices=STAND_INS, default=[], metavar="PART",
        help=f"replace these parts of gpo's step by bare stand-ins ({', '.join(STAND_INS)}): how much could trimming "
        "them save?",
    )  # fmt: skip
    parser.add_argument(
        "--accelerator", choices=["cpu", "cuda"], default="cpu",
        help="where gpo and the bare loop run (default: %(default)s); on cuda every timer waits for the GPU's queued "
        "work first",
    )  # fmt: skip
    parser.add_argument("--log-every-n-steps", type=int, default=10, help="(default: %(default)s, the quickstart's)")
    parser.add_argument(
        "--with-callbacks", action="store_true",
        help="attach DifficultyFilter (admitting every prompt: the same training work) and RolloutMonitor, to see "
        "what gpo's callbacks add to a step",
    )  # fmt: skip
    args = parser.parse_args()
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        parser.error("--accelerator cuda: torch sees no CUDA device here.")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (the first step's wall time has no previous step end).")
    if args.steps < 2 and args.profile is None and args.op_sites is None:
        parser.error("--steps must be >= 2 for the timings table: the bare work calls generate its two ways on "
                     "alternate steps.")  # fmt: skip
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*overridden after learning rate scheduler.*")  # our timers wrap step
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    print("# gpo step time\n")
    print(f"- machine: {platform.machine()}, nproc {os.cpu_count()}, {platform.platform()}")
    print(
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, lightning {L.__version__}"
    )
    print(f"- torch threads: {torch.get_num_threads()}")
    if args.accelerator == "cuda":
        print(f"- device: {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
    print(
        f"- workload: tiny llama hidden {args.hidden_size}, {args.num_layers} layers, float32; sort_digits, "
        f"{args.prompts_per_step} prompts x {args.group_size} completions, max_new_tokens {args.max_new_tokens}, "
        f"temperature 1.0; grpo, old log-probs from the batch, 1 optimiser step per batch, AdamW lr {args.lr}; "
        f"{args.warmup} warm-up + {args.steps} measured steps; loggers: {args.loggers} (every "
        f"{args.log_every_n_steps} steps)"
    )
    if args.stand_ins:
        print(f"- gpo's parts replaced by bare stand-ins: {', '.join(args.stand_ins)}")
    if args.with_callbacks:
        print("- callbacks: DifficultyFilter(low=0, high=1), RolloutMonitor()")
    print(f"- load average (1 min) before the run: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        model_path, data_path = make_workspace(Path(tmp), args)
        steps = run_gpo(model_path, data_path, Path(tmp), args)
    print(f"- load average (1 min) after the run: {os.getloadavg()[0]:.2f}")
    if args.profile is None and args.op_sites is None:
        report(steps)


if __name__ == "__main__":
    main()
