"""Prompt datasets from local files or generated from a seed, and the Lightning DataModule that serves them in
batches of prompts."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from lightning import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset
from transformers import PreTrainedTokenizerBase

from gpo.models.loading import check_pretrained_folder, load_tokenizer
from gpo.parallel import collectives
from gpo.seeds import run_seed, stream_generator, stream_seed
from gpo.tasks import GeneratedTask
from gpo.train.hooks import RolloutSource
from gpo.train.records import load_records
from gpo.train.run_state import warn_changed_settings

log = logging.getLogger(__name__)

LongPrompts = Literal["error", "truncate"]


def _tokenize(tokenizer: PreTrainedTokenizerBase, text: str, chat_template: bool) -> list[int]:
    """A prompt's token ids, wrapped in the tokenizer's chat template as a user turn when ``chat_template``."""
    if not chat_template:
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch of prompts: ``prompt_ids`` and ``prompt`` lists, and every other column under ``fields``."""
    fields = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt_ids", "prompt")}
    prompts = {"prompt_ids": [row["prompt_ids"] for row in rows], "prompt": [row["prompt"] for row in rows]}
    return {**prompts, "fields": fields}


#: What a batch of prompts holds (``collate`` makes it from rows).
BATCH_KEYS = ("prompt", "prompt_ids", "fields")


def check_batch(batch: Any) -> None:
    """Refuse a batch that is not a batch of prompts, naming what it lacks."""
    missing = [key for key in BATCH_KEYS if key not in batch] if isinstance(batch, Mapping) else list(BATCH_KEYS)
    if missing:
        shown = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"a batch of prompts holds 'prompt' (texts), 'prompt_ids' (token id lists) and 'fields' (the other "
            f"columns, for the rewards); this one lacks {missing} (it has {shown}). Use gpo.train.data."
            "PromptDataModule, or give your DataLoader rows with 'prompt' and 'prompt_ids' and "
            "collate_fn=gpo.train.data.collate."
        )


class PromptDataModule(LightningDataModule):
    """Prompts for RL: each row's prompt is tokenised once; its other columns go to the reward functions.

    Args:
        path: training prompts: a JSONL/JSON/Parquet/CSV file, a saved ``datasets`` folder, or a task generated
            from a seed (``{class_path: gpo.tasks.Arithmetic, init_args: {size: 2000}}``).
        val_path: held-out prompts for evaluation, in any form ``path`` takes (e.g. the task's ``split: test``);
            None splits off ``val_size`` rows of ``path`` instead.
        val_size: rows of ``path`` held out for evaluation when ``val_path`` is None (0: no evaluation set).
        tokenizer: tokenizer folder (or GGUF model, see ``gpo.models.loading.pretrained_path``); ``gpo fit`` links it
            to the policy's path. None: the tokenizer of the LightningModule it is trained with (its
            ``gpo.train.hooks.RolloutSource.tokenizer``, as ``GPOModule``'s).
        prompt_column: the column holding the prompt text.
        prompts_per_step: prompts per training step over all processes (each gets ``group_size`` completions);
            under DDP each of the ``W`` processes samples ``prompts_per_step / W`` of them.
        max_prompt_length: the longest prompt in tokens.
        long_prompts: ``error`` refuses a longer prompt (naming its row); ``truncate`` keeps its last
            ``max_prompt_length`` tokens and logs how many were cut.
        chat_template: wrap prompts in the tokenizer's chat template as a user turn; None applies it when the
            tokenizer has one.
        seed: seed of the data's streams, each epoch's order and the validation split, each hashed from it with
            its purpose (``gpo.seeds``); None: the run's seed (``seed_everything``), so one seed sets the whole
            experiment. Extra draws beyond a step's batch (``DynamicSampling``) follow ``model.seed``.
    """

    def __init__(
        self,
        path: GeneratedTask | str | Path,
        *,
        val_path: GeneratedTask | str | Path | None = None,
        val_size: int = 0,
        tokenizer: str | None = None,
        prompt_column: str = "prompt",
        prompts_per_step: int = 8,
        max_prompt_length: int = 512,
        long_prompts: LongPrompts = "error",
        chat_template: bool | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if prompts_per_step < 1:
            raise ValueError(f"data.prompts_per_step={prompts_per_step} must be >= 1 (prompts per training step).")
        if max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length={max_prompt_length} must be >= 1 (the longest prompt in tokens).")
        if long_prompts not in ("error", "truncate"):
            raise ValueError(f"data.long_prompts={long_prompts!r} is not valid; choose 'error' or 'truncate'.")
        if val_size < 0:
            raise ValueError(f"data.val_size={val_size} must be >= 0 (0: no held-out rows).")
        self.path, self.val_path, self.val_size = path, val_path, val_size
        self.tokenizer_path, self.prompt_column = tokenizer, prompt_column
        self.prompts_per_step, self.max_prompt_length = prompts_per_step, max_prompt_length
        self.long_prompts, self.chat_template, self.seed = long_prompts, chat_template, run_seed(seed)
        self.train_rows: list[dict[str, Any]] = []
        self.val_rows: list[dict[str, Any]] = []
        self.columns: dict[str, list[str]] = {}  # each file's columns, keyed "data.path='...'"; set by setup
        self.longest_prompt: tuple[int, str] = (0, "no prompt")  # tokens, and which row; set by setup
        # the trainer's limit_val_batches, held while a fit without held-out prompts turns validation off (setup)
        self.held_limit_val_batches: int | float | None = None

    def setup(self, stage: str | None = None) -> None:
        ranks = self.trainer.world_size if self.trainer is not None else 1
        if self.prompts_per_step % ranks:
            raise ValueError(
                f"data.prompts_per_step={self.prompts_per_step} is the global batch: it must split evenly over the "
                f"{ranks} processes (trainer.devices x trainer.num_nodes); make it a multiple of {ranks}."
            )
        if not self.train_rows:
            self._read_rows()
        if stage == TrainerFn.FITTING and self.trainer is not None and not self.val_rows:
            # nothing to evaluate: validation off (given back at teardown), or Lightning would run its sanity check
            # over an empty loader and warn that its length is zero
            self.held_limit_val_batches, self.trainer.limit_val_batches = self.trainer.limit_val_batches, 0

    def teardown(self, stage: str) -> None:
        if self.trainer is not None and self.held_limit_val_batches is not None:
            self.trainer.limit_val_batches, self.held_limit_val_batches = self.held_limit_val_batches, None

    def _read_rows(self) -> None:
        """The training and held-out rows, from ``path`` and ``val_path`` or split by ``val_size``."""
        tokenizer = self._tokenizer()
        rows = self._prepare(tokenizer, "path")
        if self.val_path is not None:
            self.train_rows, self.val_rows = rows, self._prepare(tokenizer, "val_path")
        else:
            if self.val_size >= len(rows):
                raise ValueError(
                    f"data.val_size={self.val_size} leaves no training rows out of {len(rows)}; hold out fewer."
                )
            order = torch.randperm(len(rows), generator=stream_generator("data/val_split", self.seed)).tolist()
            cut = len(rows) - self.val_size
            self.train_rows = [rows[i] for i in order[:cut]]
            self.val_rows = [rows[i] for i in order[cut:]]

    def _tokenizer(self) -> PreTrainedTokenizerBase:
        """The ``tokenizer`` folder's, else the trained LightningModule's."""
        if self.tokenizer_path is not None:
            check_pretrained_folder(self.tokenizer_path, "data.tokenizer", "tokenizer")
            return load_tokenizer(self.tokenizer_path, "data.tokenizer")
        module = self.trainer.lightning_module if self.trainer is not None else None
        if isinstance(module, RolloutSource):
            return module.tokenizer
        raise ValueError(
            "PromptDataModule has no tokenizer: pass tokenizer= (the policy's folder; `gpo fit` links it), or train "
            "it with a LightningModule that has one (a gpo.train.hooks.RolloutSource, such as GPOModule)."
        )

    def _prepare(self, tokenizer: PreTrainedTokenizerBase, name: str) -> list[dict]:
        """The rows of the file or task in argument ``name`` (``path`` or ``val_path``), tokenised and checked."""
        path = getattr(self, name)
        generated = isinstance(path, GeneratedTask)
        source = f"data.{name}={path!r}" if generated else f"data.{name}={str(path)!r}"
        try:
            records = path.records() if generated else load_records(path)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"data.{name}: {err}") from err
        except ValueError as err:
            raise ValueError(f"data.{name}: {err}") from err
        if not records:
            raise ValueError(f"{source} has no rows; point data.{name} at a file with at least one prompt.")
        if self.prompt_column not in records[0]:
            raise ValueError(
                f"{source} has no column {self.prompt_column!r} (prompt_column); its columns are: "
                f"{', '.join(records[0])}. Set data.prompt_column to the column holding the prompt text."
            )
        self.columns[source] = list(records[0])
        use_template = self.chat_template if self.chat_template is not None else bool(tokenizer.chat_template)
        if use_template and not tokenizer.chat_template:
            raise ValueError(
                "data.chat_template=True but the tokenizer has no chat template; set data.chat_template: false."
            )
        prepared, cut = [], 0
        for index, record in enumerate(records):
            text = record[self.prompt_column]
            if not isinstance(text, str):
                raise ValueError(
                    f"{source} row {index}: column {self.prompt_column!r} (data.prompt_column) holds {text!r:.80}, "
                    "not text; give every row a prompt string."
                )
            ids = _tokenize(tokenizer, text, use_template)
            if not ids:  # nothing to sample from: a batch of them crashed in generate, one among others sampled noise
                raise ValueError(
                    f"{source} row {index}: the prompt is empty (no tokens); give every row a prompt, or remove it."
                )
            if len(ids) > self.max_prompt_length:
                if self.long_prompts == "error":
                    raise ValueError(
                        f"{source} row {index}: the prompt is {len(ids)} tokens, over max_prompt_length="
                        f"{self.max_prompt_length}. Raise data.max_prompt_length or set data.long_prompts: truncate."
                    )
                ids, cut = ids[-self.max_prompt_length :], cut + 1
            if len(ids) > self.longest_prompt[0]:
                self.longest_prompt = (len(ids), f"{source} row {index}")
            fields = {k: v for k, v in record.items() if k != self.prompt_column}
            prepared.append({"prompt_ids": ids, "prompt": text, **fields})
        if cut:
            log.warning("%s: %d prompts longer than %d tokens were truncated.", source, cut, self.max_prompt_length)
        return prepared

    def train_dataloader(self) -> PromptLoader:
        trainer = self.trainer

        def batches_trained() -> int:  # what the fit loop has finished of this epoch, prefetched batches excluded
            return trainer.fit_loop.epoch_loop.batch_progress.current.processed if trainer is not None else 0

        rank, ranks = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return PromptLoader(
            self.train_rows, self.prompts_per_step // ranks, seed=self.seed, batches_trained=batches_trained,
            rank=rank, world_size=ranks,
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """The held-out prompts; none (no evaluation, and no warning about an empty loader) while fitting a run
        without them. Validating without them is refused: it would evaluate nothing and say nothing."""
        if self.val_rows:
            return DataLoader(self.val_rows, batch_size=self.prompts_per_step, shuffle=False, collate_fn=collate)
        if self.trainer is not None and self.trainer.state.fn == TrainerFn.VALIDATING:
            raise ValueError("validating needs held-out prompts: set data.val_path (a file of them) or data.val_size "
                             "(rows held out of data.path).")  # fmt: skip
        return []

    def settings(self) -> dict[str, str]:
        """The settings that decide which prompts a run trains on and in what order, by their configuration keys."""
        values = {"path": self.path, "val_path": self.val_path, "val_size": self.val_size,
                  "prompt_column": self.prompt_column, "prompts_per_step": self.prompts_per_step,
                  "max_prompt_length": self.max_prompt_length, "long_prompts": self.long_prompts,
                  "chat_template": self.chat_template, "seed": self.seed}  # fmt: skip
        return {f"data.{key}": repr(value) for key, value in values.items()}

    def state_dict(self) -> dict[str, Any]:
        """The data settings, for a resume to compare (``load_state_dict``); the place in the epoch is the
        loader's (``PromptLoader.state_dict``)."""
        return {"settings": self.settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Warn, naming each, about data settings changed since the checkpoint a fit resumes (evaluating a
        checkpoint on other data is no change to warn about)."""
        if self.trainer is not None and self.trainer.state.fn == TrainerFn.FITTING:
            warn_changed_settings(state.get("settings", {}), self.settings())

    def transfer_batch_to_device(self, batch: dict[str, Any], device: torch.device, dataloader_idx: int) -> dict:
        return batch  # token-id lists and strings: the engine puts the prompts where it samples (Lightning's walk
        # through every string of the batch cost about 0.3 ms a step)


class EpochOrder(DistributedSampler):
    """Row order of one epoch, this process's share of it: a permutation drawn from ``(seed, epoch)`` alone (the
    stream ``gpo.seeds.stream_seed("data/order", seed, epoch)``), so any epoch can be replayed.

    With ``world_size`` W > 1 the permutation is padded to a multiple of W by repeating its first rows (as torch's
    ``DistributedSampler`` does) and rank ``r`` takes rows ``r, r + W, r + 2W, ...``. Batches of ``P / W`` rows per
    rank then make global batch ``b`` rows ``[b P, (b + 1) P)`` of the permutation for any W, the batch a single
    process with batch size ``P`` draws; and minibatch ``k`` of every rank's share together are minibatch ``k`` of
    that single-process batch. Being a ``DistributedSampler``, it is left in place by Lightning, which would
    otherwise wrap the loader's sampler in one of its own.

    ``resume(epoch, rows_done)`` makes the next pass over that epoch skip its first ``rows_done`` rows of this
    rank's share (once); ``len`` stays the whole share, as Lightning's loop expects of a resumed loader.
    """

    def __init__(self, size: int, seed: int, *, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self.size, self._skip = size, (0, 0)

    def resume(self, epoch: int, rows_done: int) -> None:
        self.epoch, self._skip = epoch, (epoch, rows_done)

    def order(self, epoch: int) -> list[int]:
        """The whole epoch's permutation (every rank's rows)."""
        return torch.randperm(self.size, generator=stream_generator("data/order", self.seed, epoch)).tolist()

    def __iter__(self):
        skip_epoch, rows_done = self._skip
        self._skip = (0, 0)
        start = rows_done if skip_epoch == self.epoch else 0
        rows = self.order(self.epoch)
        if self.num_replicas > 1:
            rows = (rows * math.ceil(self.total_size / max(len(rows), 1)))[: self.total_size]
            rows = rows[self.rank :: self.num_replicas]
        yield from rows[start:]

    def __len__(self) -> int:
        return self.num_samples


class PromptLoader(DataLoader):
    """Batches of prompts whose place in the run can be saved and restored (Lightning calls ``state_dict`` when it
    checkpoints and ``load_state_dict`` before the first batch of a resumed run).

    Args:
        rows: prepared prompt rows.
        batch_size: prompts per batch.
        seed: the data seed; epoch ``e``'s order is drawn from ``(seed, e)`` (see ``EpochOrder``).
        batches_trained: how many batches of the current epoch have been trained on when a checkpoint is written
            (the training loop's count: a loader cannot tell a batch trained on from one only prefetched).
        rank: this process's rank; with ``world_size`` > 1 it loads its share of each epoch (see ``EpochOrder``).
        world_size: number of processes sharing the epoch.
    """

    def __init__(
        self, rows: list[dict[str, Any]], batch_size: int, *, seed: int, batches_trained, rank: int = 0,
        world_size: int = 1,
    ) -> None:  # fmt: skip
        self.order = EpochOrder(len(rows), seed, rank=rank, world_size=world_size)
        # its own generator: starting an iterator would otherwise draw a worker seed from torch's global one
        generator = stream_generator("data/workers", seed)
        super().__init__(rows, batch_size=batch_size, sampler=self.order, collate_fn=collate, generator=generator)
        self.batches_trained = batches_trained
        self.resumed = (0, 0, 0)  # the epoch, batches and prompts done of the checkpoint this run resumed

    def state_dict(self) -> dict[str, int]:
        """The epoch, and how many of its prompts the trained batches took over all processes: those of the run this
        one resumed (whose batches may have had another size), then this run's."""
        batches, (epoch, batches_before, prompts_before) = int(self.batches_trained()), self.resumed
        if epoch != self.order.epoch:
            batches_before = prompts_before = 0
        prompts = prompts_before + (batches - batches_before) * self.batch_size * self.order.num_replicas
        return {"epoch": self.order.epoch, "batches_done": batches, "prompts_done": prompts}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Go on after the prompts done, whatever the batch size or the number of processes now."""
        ranks = self.order.num_replicas
        prompts_done = state.get("prompts_done", state["batches_done"] * self.batch_size * ranks)  # older checkpoints
        self.resumed = (state["epoch"], state["batches_done"], prompts_done)
        self.order.resume(state["epoch"], prompts_done // ranks)


class PromptDraws:
    """More batches of training prompts, for callbacks that draw beyond a step's own batch (``DynamicSampling``),
    from passes over the data of their own.

    Pass ``k`` is shuffled by ``stream_seed("data/draws", seed, k)`` alone (never a training epoch's order) and
    ``drawn`` (the count so far) is checkpointed, so a resumed run draws the same batches (for map-style datasets;
    an iterable dataset is iterated on, and again whenever it runs out, from its start after a resume). Under DDP
    each rank draws from its own share of each pass.

    Args:
        loader: the training loader whose rows and batching the draws reuse.
        seed: the seed its passes are drawn from.
        drawn: batches already drawn (from a checkpoint).
    """

    def __init__(self, loader: DataLoader, seed: int, drawn: int = 0) -> None:
        self.loader, self.seed, self.drawn = loader, seed, drawn
        self.per_pass = batches_per_pass(loader)
        self._batches: Iterator[dict[str, Any]] | None = None

    def __iter__(self) -> PromptDraws:
        return self

    def __next__(self) -> dict[str, Any]:
        self.drawn += 1
        if self.per_pass is None:  # an iterable dataset: iterated on, and again whenever it runs out
            batch = next(self._batches, None) if self._batches is not None else None
            if batch is None:
                self._batches = iter(self.loader)
                batch = next(self._batches)
            return batch
        passes, offset = divmod(self.drawn - 1, self.per_pass)
        if self._batches is None or offset == 0:
            seed = stream_seed("data/draws", self.seed, passes)
            self._batches = itertools.islice(iter(reshuffled(self.loader, seed)), offset, None)
        return next(self._batches)


def batches_per_pass(loader: DataLoader) -> int | None:
    """Batches in one of ``reshuffled``'s passes of this process over a map-style dataset with a fixed batch size
    (whatever the loader's own sampler draws); None for anything else."""
    if isinstance(loader.dataset, IterableDataset) or not loader.batch_size:
        return None
    return len(reshuffled(loader, 0))


def reshuffled(loader: DataLoader, seed: int) -> DataLoader:
    """``loader``'s rows and batching in an order drawn from ``seed`` alone (this rank's share of it under DDP)."""
    order = EpochOrder(len(loader.dataset), seed, rank=collectives.rank(), world_size=collectives.world_size())
    # A generator of its own also keeps the loader's worker seed off torch's global generator, which would
    # otherwise be drawn from whenever an iterator starts (and a resumed run starts them at other times).
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=order, collate_fn=loader.collate_fn,
        generator=stream_generator("data/workers", seed),
    )  # fmt: skip
