"""What a rollout is, and the interface every rollout engine implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:  # gpo.callbacks imports this file and stays free of transformers
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled.

    Args:
        temperature: softmax temperature (> 0); the trainer scores tokens at the same temperature.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        max_new_tokens: completion length budget; a completion that reaches it without EOS is truncated.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        where = "model.engine.init_args.sampling"  # every engine takes one ``sampling`` argument
        check_temperature_and_top_p(self.temperature, self.top_p, where)
        if self.top_k < 0:
            raise ValueError(f"{where}.top_k={self.top_k} must be >= 0 (0 disables it).")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"{where}.max_new_tokens={self.max_new_tokens} must be >= 1 (the completion budget in tokens)."
            )


def sampling_or_default(sampling: Sampling | None, engine: str) -> Sampling:
    """``sampling``, or the default ``Sampling()`` for None; anything else (a dict of its fields, say) is refused
    naming ``engine``, as it would fail at the first rollout with an AttributeError."""
    if sampling is None:
        return Sampling()
    if not isinstance(sampling, Sampling):
        shown = f"{sampling!r:.60}" if isinstance(sampling, dict) else type(sampling).__name__
        raise TypeError(f"{engine}(sampling={shown}) takes gpo.rollout.Sampling(temperature=..., top_p=..., top_k=..., "
                        "max_new_tokens=...); the mapping form is for YAML.")  # fmt: skip
    return sampling


def check_temperature_and_top_p(temperature: float, top_p: float, where: str) -> None:
    """Refuse a temperature or nucleus mass out of bounds, naming it under ``where``, its configuration group."""
    if not temperature > 0:
        raise ValueError(
            f"{where}.temperature={temperature} must be > 0 (1.0 samples the policy as is; evaluation decodes "
            "greedily on its own)."
        )
    if not 0 < top_p <= 1:
        raise ValueError(f"{where}.top_p={top_p} must be in (0, 1] (1 disables it).")


@dataclass
class Rollout:
    """``B`` completions (``n`` per prompt, rows of a group adjacent) and everything known about them.

    Token tensors put the prompt left-padded to ``P`` and the completion right-padded to ``T``, so
    ``torch.cat([prompt_ids, completion_ids], 1)`` is the model input of every row.
    """

    prompt_ids: Tensor  # [B, P] long, left-padded
    prompt_mask: Tensor  # [B, P] 1 on prompt tokens
    completion_ids: Tensor  # [B, T] long, right-padded
    completion_mask: Tensor  # [B, T] 1 on generated tokens, EOS included
    truncated: Tensor  # [B] bool: reached max_new_tokens without EOS
    group: Tensor  # [B] long: which prompt of the batch
    logp: Tensor | None = None  # [B, T] float32: the sampler's log-probs of the completion tokens
    prompts: list[str] = field(default_factory=list)  # [B]
    completions: list[str] = field(default_factory=list)  # [B]
    fields: dict[str, list] = field(default_factory=dict)  # extra dataset columns, one value per row
    scores: Tensor | None = None  # [B, K] float32: one column per reward function, once scored
    reward: Tensor | None = None  # [B] float32: the mixed reward, once scored
    # [B, T] 1 on completion tokens that train; None: ``completion_mask``. Multi-turn rollouts put environment
    # tokens in the context (``completion_mask`` 1) but out of the loss (``loss_mask`` 0). Set it anew whenever
    # ``completion_mask`` changes.
    loss_mask: Tensor | None = None
    # Multi-turn episodes (``MultiTurnEngine``): each policy turn's step reward, NaN past the episode's last turn,
    # and the policy turn of each completion token, -1 on environment tokens and padding.
    turn_rewards: Tensor | None = None  # [B, K] float32
    turn_index: Tensor | None = None  # [B, T] long
    # Pipelined rollouts (``max_off_policy_steps`` >= 1): the policy version that sampled each row, counted in
    # training steps taken before its weights were pushed to the sampler; None: sampled by the current policy.
    version: Tensor | None = None  # [B] long
    # A KL penalty placed in the reward: each row's KL estimate to the reference summed over its policy tokens
    # (``reward`` holds ``-beta`` times it).
    reward_kl: Tensor | None = None  # [B] float32

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def check_rows(self) -> None:
        """Refuse a rollout whose fields hold another row count than ``completion_ids`` (a text list left empty is
        fine), or whose ``reward`` is not one value per row."""
        rows, counts = len(self), {}
        for name, value in ((f.name, getattr(self, f.name)) for f in fields(self)):
            if isinstance(value, Tensor):
                counts[name] = value.shape[0] if value.dim() else 0
            elif isinstance(value, list) and value:
                counts[name] = len(value)
            elif isinstance(value, dict):
                counts |= {f"{name}[{key!r}]": len(column) for key, column in value.items()}
        wrong = [(where, count) for where, count in counts.items() if count != rows]
        if wrong:
            raise ValueError(f"the rollout's {wrong[0][0]} has {wrong[0][1]} rows, its completion_ids {rows}.")
        if self.reward is not None and not (isinstance(self.reward, Tensor) and self.reward.dim() == 1):
            shown = tuple(self.reward.shape) if isinstance(self.reward, Tensor) else type(self.reward).__name__
            raise ValueError(f"the rollout's reward must be a [{rows}] tensor, one value per row, not {shown}.")

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # [B, P + T]

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)  # [B, P + T]

    @property
    def lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)  # [B]

    def select(self, rows: Tensor | list[int]) -> Rollout:
        """The rollout restricted to ``rows`` (in that order): every per-row field, tensor, list or dict of lists."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.completion_ids.device)
        picked = index.tolist()

        def pick(value: Any) -> Any:
            if isinstance(value, Tensor):
                return value[index]
            if isinstance(value, dict):
                return {key: pick(values) for key, values in value.items()}
            if isinstance(value, list):
                return [value[i] for i in picked] if value else []  # a text list left empty: a new empty one
            return value  # None

        return replace(self, **{f.name: pick(getattr(self, f.name)) for f in fields(self)})

    def to(self, device: torch.device | str) -> Rollout:
        """The rollout with every tensor on ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{name: value.to(device) for name, value in moved.items() if isinstance(value, Tensor)})

    @property
    def num_groups(self) -> int:
        return int(torch.unique(self.group).numel())


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """What rollouts are padded with (``RolloutEngine.generate``): the tokenizer's pad token, else its EOS."""
    return tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def concat_rollouts(rollouts: list[Rollout]) -> Rollout:
    """One rollout from several: prompts re-padded on the left, completions on the right (with id 0 under a zero
    mask), group ids renumbered so groups of different parts stay distinct."""
    if len(rollouts) == 1:
        return rollouts[0]
    keys = rollouts[0].fields.keys()
    for index, rollout in enumerate(rollouts[1:], 1):
        if rollout.fields.keys() != keys:
            raise ValueError(
                f"rollouts joined into one must carry the same dataset fields: the first has {sorted(keys)}, part "
                f"{index} has {sorted(rollout.fields)} (a rollout drawn by RolloutSource.draw_rollout must carry "
                "the step's fields)."
            )
    width_p = max(r.prompt_ids.shape[1] for r in rollouts)
    width_t = max(r.completion_ids.shape[1] for r in rollouts)
    max_turns = max(0 if r.turn_rewards is None else r.turn_rewards.shape[1] for r in rollouts)

    right = _pad_right(width_t, 0)

    def left(x: Tensor) -> Tensor:
        return torch.nn.functional.pad(x, (width_p - x.shape[1], 0))

    groups, offset = [], 0
    for r in rollouts:
        _, index = torch.unique(r.group, return_inverse=True)
        groups.append(index + offset)
        offset += int(index.max()) + 1 if len(r) else 0

    def cat_optional(name: str, pad=None) -> Tensor | None:
        parts = [getattr(r, name) for r in rollouts]
        if any(p is None for p in parts):
            return None
        return torch.cat([pad(p) if pad else p for p in parts])

    return Rollout(
        prompt_ids=torch.cat([left(r.prompt_ids) for r in rollouts]),
        prompt_mask=torch.cat([left(r.prompt_mask) for r in rollouts]),
        completion_ids=torch.cat([right(r.completion_ids) for r in rollouts]),
        completion_mask=torch.cat([right(r.completion_mask) for r in rollouts]),
        truncated=torch.cat([r.truncated for r in rollouts]),
        group=torch.cat(groups),
        logp=cat_optional("logp", right),
        prompts=[p for r in rollouts for p in r.prompts],
        completions=[c for r in rollouts for c in r.completions],
        fields={key: [v for r in rollouts for v in r.fields[key]] for key in keys},
        scores=cat_optional("scores"),
        reward=cat_optional("reward"),
        loss_mask=torch.cat([right(r.loss_mask) for r in rollouts]),
        turn_rewards=cat_optional("turn_rewards", _pad_right(max_turns, float("nan"))),
        turn_index=cat_optional("turn_index", _pad_right(width_t, -1)),
        version=cat_optional("version"),
        reward_kl=cat_optional("reward_kl"),
    )


def _pad_right(width: int, value: float):
    """Right-padding of ``[B, W]`` tensors to ``[B, width]`` with ``value``."""
    return lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


class RolloutEngine(ABC):
    """Samples ``n`` completions for each prompt. The trainer only ever sees this interface, never a concrete engine.

    Attributes every engine declares:
        sampling: how completions are sampled (temperature, top-p, top-k, length budget); the trainer scores tokens
            at the same temperature.
        shares_policy_weights: the engine samples from the very module being trained (no copy of the weights to keep
            in sync): its log-probs equal the trainer's, so the trainer does not measure a mismatch.
        serves_all_ranks: one engine (a server) serves every training process: weight updates come from rank 0 alone.
        episodic: the engine plays environment episodes: its rollouts carry ``turn_rewards`` and ``turn_index``, which
            per-turn credit (``model.step_rewards``) needs. Its ``generate`` also takes ``tasks``, the prompts' text
            (the dataset's prompt column, before a chat template), which it hands to the environment.
        draws_global_generator: its sampling draws from torch's process-wide generator whatever the seed it is
            given (vLLM in this process does): on a pipeline's sampler thread those draws interleave with the
            trainer's own (dropout) at times that vary from run to run.
    """

    sampling: Sampling
    shares_policy_weights: bool = False
    serves_all_ranks: bool = False
    episodic: bool = False
    draws_global_generator: bool = False

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:  # noqa: B027
        """Called once by the trainer with the policy it trains; engines with their own weights may ignore it."""

    @abstractmethod
    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        *,
        greedy: bool = False,
        seed: int | None = None,
        logprobs: bool = True,
        sampling: Sampling | None = None,
    ) -> Rollout:
        """Sample ``n`` completions of each prompt (token ids, no padding); rows of prompt ``i`` get group ``i``.

        Returns a ``Rollout`` with token tensors, ``truncated``, ``group`` and, when ``logprobs`` is asked for and the
        engine has them, the sampled tokens' ``logp`` at the sampling temperature. Padding, in the prompts and after
        the completions, is the tokenizer's pad token (its EOS when it has none), so decoding with
        ``skip_special_tokens`` drops it. Texts and dataset fields are the caller's to add; an engine may add fields
        of its own (a multi-turn engine's episode records). ``sampling`` replaces the engine's own settings for this
        call (held-out evaluation samples at its own temperature and top-p)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Replace the engine's copy of the weights with ``(name, tensor)`` pairs named as in the transformers
        checkpoint; engines that sample from the trained module itself have no copy to update."""
        raise NotImplementedError(
            f"{type(self).__name__} samples from the trained policy itself and holds no weights of its own to update; "
            "weight sync (VLLMWeightSync) is for engines with their own copy (VLLMEngine, VLLMServerEngine)."
        )
