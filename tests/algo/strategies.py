"""Hypothesis strategies for the gpo.algo fuzz tests: ragged groups, masks with empty and truncated rows,
rewards and log-probs at the edges of float32, and every ratio gate with the extra inputs it requires."""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch import Tensor

from gpo.algo import (
    CISPOGate,
    ClipGate,
    ConstantNorm,
    DivergenceMaskGate,
    DROGate,
    GeometricMeanGate,
    HighEntropyMask,
    MismatchBandMask,
    NoGate,
    OffPolicySequenceMask,
    RouterShiftGate,
    SecondMomentMask,
    SequenceClipGate,
    SequenceMean,
    SequenceSum,
    SoftGate,
    TokenMean,
    VESPOGate,
)

MAX_ROWS, MAX_TOKENS, MAX_GROUP = 12, 9, 6
LAYERS, EXPERTS, VOCAB = 2, 4, 5
PAD_VALUES = (math.nan, math.inf, -math.inf, 30.0)  # what padded positions may hold; none may leak


def fuzz(max_examples: int = 30) -> settings:
    """Hypothesis settings of the fuzz tests: few examples, no deadline, no example database on disk.

    The examples are the same on every run (``derandomize``: drawn from a seed fixed per test), so a test that
    passed once passes in CI too, and a failure reproduces. A search for new cases is a run by hand:
    ``GPO_FUZZ_EXPLORE=1`` draws fresh examples each run and ``GPO_FUZZ_SCALE=20`` multiplies their number. The
    autouse tmp-dir fixture is function-scoped; sharing it across the examples of one test is harmless.
    """
    return settings(
        max_examples=max_examples * int(os.environ.get("GPO_FUZZ_SCALE", "1")),
        derandomize=os.environ.get("GPO_FUZZ_EXPLORE", "0") != "1",
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def f32(values) -> Tensor:
    return torch.tensor(values, dtype=torch.float32)


def floats32(low: float, high: float) -> st.SearchStrategy[float]:
    """float32 values in ``[low, high]``; subnormals are left out (they carry too few bits to compare)."""
    return st.floats(low, high, width=32, allow_subnormal=False)


# ---------------------------------------------------------------------------------------------- batch layout


@st.composite
def group_sizes(draw) -> list[int]:
    """Sizes of the groups of one batch (1..12 rows): one group, groups of two, or ragged groups of 1..6."""
    kind = draw(st.sampled_from(["ragged", "single", "pairs"]))
    if kind == "single":
        return [draw(st.integers(1, MAX_GROUP))]
    if kind == "pairs":
        return [2] * draw(st.integers(1, MAX_ROWS // 2))
    sizes = []
    for size in draw(st.lists(st.integers(1, MAX_GROUP), min_size=1, max_size=MAX_ROWS)):
        if sum(sizes) + size > MAX_ROWS:
            break
        sizes.append(size)
    return sizes


@st.composite
def group_labels(draw, sizes: list[int]) -> list[int]:
    """Contiguous label ``0..G-1`` of every row; rows of one group need not be adjacent."""
    return draw(st.permutations([g for g, n in enumerate(sizes) for _ in range(n)]))


@st.composite
def group_ids(draw, labels: list[int]) -> Tensor:
    """``[B]`` arbitrary, non-contiguous, possibly negative group ids standing for ``labels``."""
    ids = draw(st.lists(st.integers(-1000, 1000), min_size=max(labels) + 1, max_size=max(labels) + 1, unique=True))
    return torch.tensor([ids[g] for g in labels])


@st.composite
def masks(draw, rows: int, tokens: int, holes: bool = True) -> Tensor:
    """``[B, T]`` float 0/1: empty rows (empty completions), full rows (truncated ones), prefixes and, with
    ``holes``, any pattern (multi-turn masks); sometimes the whole batch is empty."""
    if draw(st.integers(0, 7)) == 7:
        return torch.zeros(rows, tokens)
    kinds = ["prefix", "empty", "full"] + (["holes"] if holes else [])
    out = []
    for _ in range(rows):
        kind = draw(st.sampled_from(kinds))
        if kind == "holes":
            out.append(draw(st.lists(st.booleans(), min_size=tokens, max_size=tokens)))
        else:
            n = 0 if kind == "empty" else tokens if kind == "full" else draw(st.integers(0, tokens))
            out.append([True] * n + [False] * (tokens - n))
    return f32(out)


@st.composite
def group_constant_rewards(draw) -> tuple[Tensor, Tensor]:
    """``(reward[B], group[B])`` where every group's rewards are equal (any float32 value up to 1e6)."""
    labels = draw(group_labels(draw(group_sizes())))
    per_group = draw(st.lists(floats32(-1e6, 1e6), min_size=max(labels) + 1, max_size=max(labels) + 1))
    return f32([per_group[g] for g in labels]), draw(group_ids(labels))


# ---------------------------------------------------------------------------------------------- values

REWARD_SCALES = (1.0, 1e6, 1e-8, 1e3)


@st.composite
def rewards(draw, labels: list[int]) -> Tensor:
    """``[B]`` float32 rewards: spread, binary, constant within each group, or equal over the whole batch,
    scaled by 1, 1e6, 1e-8 or 1e3 and possibly negative."""
    kind = draw(st.sampled_from(["spread", "binary", "group_constant", "all_equal"]))
    scale = draw(st.sampled_from(REWARD_SCALES))
    unit = floats32(-1, 1)
    if kind == "spread":
        values = [draw(unit) for _ in labels]
    elif kind == "binary":
        values = [float(draw(st.booleans())) for _ in labels]
    elif kind == "group_constant":
        per_group = [draw(unit) for _ in range(max(labels) + 1)]
        values = [per_group[g] for g in labels]
    else:
        values = [draw(unit)] * len(labels)
    offset = draw(st.sampled_from([0.0, -0.5, 3.0]))
    return f32([(v + offset) * scale for v in values])


LOG_RATIO_KINDS = {
    "on_policy": st.just(0.0),
    "near": floats32(-0.25, 0.25),
    "far": floats32(-20, 20),
    "mixed": st.one_of(floats32(-0.25, 0.25), st.sampled_from([-20.0, 20.0, 0.0])),
}
ADVANTAGES = st.one_of(st.just(0.0), floats32(-3, 3), floats32(-1e6, 1e6))


def _grid(draw, shape: tuple[int, int], element) -> Tensor:
    rows, cols = shape
    return torch.tensor([[draw(element) for _ in range(cols)] for _ in range(rows)], dtype=torch.float64)


def fill_padding(x: Tensor, mask: Tensor, value: float) -> Tensor:
    """``x`` with ``value`` at every padded position (``mask == 0``)."""
    return x.masked_fill(mask == 0, value)


@dataclass
class Case:
    """One fuzzed batch. Every ``[B, T]`` tensor but ``adv`` holds garbage (NaN, +-inf or 30) on padding.

    ``adv`` is zero on padding, as every advantage estimator returns it; it is constant over each row's
    tokens unless drawn with ``token_adv``.
    """

    group: Tensor  # [B] arbitrary ids
    labels: list[int]  # [B] contiguous group labels
    mask: Tensor  # [B, T] float32 0/1
    reward: Tensor  # [B]
    seq_adv: Tensor  # [B]
    adv: Tensor  # [B, T]
    logp: Tensor  # [B, T] leaf with grad, <= 0 on real tokens
    old_logp: Tensor  # [B, T] <= 0 on real tokens
    ref_logp: Tensor  # [B, T] <= 0 on real tokens
    entropy: Tensor  # [B, T] >= 0 on real tokens
    seed: int  # for the auxiliary random inputs (router and top-k log-probs)

    @property
    def padding(self) -> Tensor:
        return self.mask == 0


@st.composite
def cases(draw, token_adv: bool = False, holes: bool = True) -> Case:
    sizes = draw(group_sizes())
    labels = draw(group_labels(sizes))
    rows, tokens = len(labels), draw(st.integers(1, MAX_TOKENS))
    mask = draw(masks(rows, tokens, holes))
    group, reward = draw(group_ids(labels)), draw(rewards(labels))

    seq_adv = f32([draw(ADVANTAGES) for _ in range(rows)])
    adv = _grid(draw, (rows, tokens), ADVANTAGES).float() if token_adv else seq_adv[:, None].expand(rows, tokens)
    adv = adv * mask

    # log pi and log pi_old both <= 0 with log pi - log pi_old = log_ratio: the larger of the two sits u below 0
    log_ratio = _grid(draw, (rows, tokens), LOG_RATIO_KINDS[draw(st.sampled_from(list(LOG_RATIO_KINDS)))])
    u = _grid(draw, (rows, tokens), st.one_of(st.just(0.0), floats32(0, 10)))
    logp = -u + log_ratio.clamp(max=0)
    old_logp = -u - log_ratio.clamp(min=0)
    ref_logp = -_grid(draw, (rows, tokens), floats32(0, 25))
    entropy = _grid(draw, (rows, tokens), floats32(0, 5))

    pads = [draw(st.sampled_from(PAD_VALUES)) for _ in range(4)]
    logp, old_logp, ref_logp, entropy = (
        fill_padding(x.float(), mask, pad) for x, pad in zip((logp, old_logp, ref_logp, entropy), pads, strict=True)
    )
    return Case(
        group=group,
        labels=labels,
        mask=mask,
        reward=reward,
        seq_adv=seq_adv,
        adv=adv,
        logp=logp.requires_grad_(True),
        old_logp=old_logp,
        ref_logp=ref_logp,
        entropy=entropy,
        seed=draw(st.integers(0, 2**16)),
    )


# ---------------------------------------------------------------------------------------------- parts

CLIP = st.floats(0.01, 0.9)
POSITIVE = st.floats(0.05, 5.0)

TOKEN_GATES = st.one_of(
    st.builds(NoGate),
    st.builds(ClipGate, clip_low=CLIP, clip_high=CLIP, dual_clip=st.one_of(st.none(), st.floats(1.5, 10))),
    st.builds(CISPOGate, clip_low=CLIP, clip_high=CLIP),
    st.builds(SoftGate, tau_pos=POSITIVE, tau_neg=POSITIVE),
    st.builds(DROGate, beta=POSITIVE),
    st.builds(
        DivergenceMaskGate,
        mode=st.sampled_from(["binary_tv", "binary_kl", "topk_tv", "topk_kl"]),
        threshold=st.floats(1e-3, 1.0),
    ),
)
# gates whose gradient is per token, so each token may carry its own advantage
PER_TOKEN_GATES = st.one_of(
    TOKEN_GATES,
    st.builds(SequenceClipGate, clip_low=CLIP, clip_high=CLIP, per_token_advantage=st.just(True)),
    st.builds(VESPOGate, k_pos=POSITIVE, lambda_pos=POSITIVE, k_neg=POSITIVE, lambda_neg=POSITIVE),
)
SEQUENCE_GATES = st.one_of(
    st.builds(SequenceClipGate, clip_low=CLIP, clip_high=CLIP, per_token_advantage=st.booleans()),
    st.builds(GeometricMeanGate, clip_low=CLIP, clip_high=CLIP),
    st.builds(VESPOGate, k_pos=POSITIVE, lambda_pos=POSITIVE, k_neg=POSITIVE, lambda_neg=POSITIVE),
    st.builds(
        RouterShiftGate,
        top_k=st.integers(1, EXPERTS),
        gamma_min=st.floats(0.01, 1.0),
        clip_low=CLIP,
        clip_high=CLIP,
    ),
)
ALL_GATES = st.one_of(TOKEN_GATES, SEQUENCE_GATES)
AGGREGATORS = st.one_of(
    st.builds(TokenMean),
    st.builds(SequenceMean),
    st.builds(SequenceSum),
    st.builds(ConstantNorm, max_length=st.integers(1, 2 * MAX_TOKENS)),
)


def gate_inputs(gate, case: Case, same_router: bool = False) -> dict[str, Tensor]:
    """The extra keyword inputs ``gate.requires``: router log-probs ``[L, B, T, E]`` or top-k log-probs
    ``[B, T, k]``, NaN on padding. ``same_router`` gives the new router the old one's log-probs."""
    gen = torch.Generator().manual_seed(case.seed)
    rows, tokens = case.mask.shape
    pad = case.padding
    if "router_logp" in gate.requires:
        old = (2 * torch.randn(LAYERS, rows, tokens, EXPERTS, generator=gen)).log_softmax(-1)
        new = old.clone() if same_router else (old + torch.randn(old.shape, generator=gen)).log_softmax(-1)
        where = pad[None, :, :, None].expand_as(old)
        return {"router_logp": new.masked_fill(where, math.nan), "old_router_logp": old.masked_fill(where, math.nan)}
    if "topk_logp" in gate.requires:
        k = 1 + case.seed % 3
        logits = 3 * torch.randn(rows, tokens, VOCAB, generator=gen)
        old = logits.log_softmax(-1)
        new = (logits + torch.randn(logits.shape, generator=gen)).log_softmax(-1)
        top = old.topk(k, dim=-1).indices
        where = pad[:, :, None].expand(rows, tokens, k)
        return {
            "topk_logp": new.gather(-1, top).masked_fill(where, math.nan),
            "old_topk_logp": old.gather(-1, top).masked_fill(where, math.nan),
        }
    return {}


# masks that read the current policy (per update) and masks of step inputs; OffPolicySequenceMask and the step masks
# are per row or fixed for the step, HighEntropyMask depends on the micro-batch it sees
ROW_MASKS = st.one_of(
    st.builds(OffPolicySequenceMask, threshold=st.floats(1e-3, 2.0)),
    st.builds(SecondMomentMask, bound=st.floats(1e-4, 1.0)),
    st.builds(MismatchBandMask, low=st.floats(0.05, 1.0), high=st.floats(1.0, 20.0)),
)
TOKEN_MASKS = st.one_of(ROW_MASKS, st.builds(HighEntropyMask, quantile=st.floats(0.0, 1.0)))


def step_inputs(case: Case) -> dict[str, Tensor]:
    """``train_logp``, ``rollout_logp`` and ``teacher_logp`` ``[B, T]`` (<= 0 on real tokens, NaN on padding): the
    trainer near the old policy, the engine off from it by up to e^+-3 (IcePop's band and beyond), a teacher."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    shape = case.mask.shape
    train = case.old_logp.detach() - torch.rand(shape, generator=gen) * 0.1
    rollout = train - 3 * torch.rand(shape, generator=gen) ** 3 * torch.randn(shape, generator=gen).sign()
    teacher = -5 * torch.rand(shape, generator=gen)
    pad = case.padding
    return {
        "train_logp": train.masked_fill(pad, math.nan),
        "rollout_logp": rollout.clamp(max=0).masked_fill(pad, math.nan),
        "teacher_logp": teacher.masked_fill(pad, math.nan),
    }


def split_rows(extra: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """The rows ``rows`` of every extra gate input (router inputs carry the batch on axis 1)."""
    return {key: value[:, rows] if key.endswith("router_logp") else value[rows] for key, value in extra.items()}


@st.composite
def row_splits(draw, rows: int) -> list[Tensor]:
    """A random split of ``0..rows-1`` into contiguous micro-batches."""
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=rows - 1))) if rows > 1 else []
    bounds = [0, *cuts, rows]
    return [torch.arange(a, b) for a, b in itertools.pairwise(bounds)]


def make_case(mask, logp, old_logp, *, seq_adv=None, ref_logp=None) -> Case:
    """A hand-written ``Case`` for ``@example``: one group, zero rewards, zero entropy."""
    mask = f32(mask)
    rows, tokens = mask.shape
    seq_adv = f32(seq_adv if seq_adv is not None else [0.0] * rows)
    return Case(
        group=torch.zeros(rows, dtype=torch.long),
        labels=[0] * rows,
        mask=mask,
        reward=torch.zeros(rows),
        seq_adv=seq_adv,
        adv=seq_adv[:, None] * mask,
        logp=f32(logp).requires_grad_(True),
        old_logp=f32(old_logp),
        ref_logp=f32(ref_logp if ref_logp is not None else old_logp),
        entropy=torch.zeros(rows, tokens),
        seed=0,
    )
