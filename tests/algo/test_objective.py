"""The policy objective's slots: masks (per update and per step), distillation, the inputs it requires, and the
adaptive entropy state it carries between steps."""

import math

import pytest
import torch

from gpo.algo import (
    AdaptiveEntropy,
    ClipGate,
    DivergenceMaskGate,
    EntropyBonus,
    HighEntropyMask,
    KLPenalty,
    MismatchBandMask,
    NoGate,
    OffPolicySequenceMask,
    OverlongFilter,
    ReferenceProbWeight,
    RouterShiftGate,
    SecondMomentMask,
    SequenceMean,
    TeacherKL,
    TokenMean,
)
from gpo.algo.objective import PolicyObjective
from gpo.algo.weighting import TokenWeight


def grad_of(value, x):
    (g,) = torch.autograd.grad(value, x, retain_graph=True)
    return g


def test_requires_is_the_union_of_what_the_parts_read_beyond_the_pass():
    objective = PolicyObjective(
        ClipGate(),
        TokenMean(),
        masks=[SecondMomentMask(), OffPolicySequenceMask(threshold=0.5), HighEntropyMask(), MismatchBandMask()],
        distill=TeacherKL(),
    )
    # logp, old_logp, adv and entropy are always in a gradient pass: they are not asked of the trainer
    assert objective.requires == {"train_logp", "rollout_logp", "teacher_logp"}
    assert [type(m) for m in objective.step_masks] == [SecondMomentMask, MismatchBandMask]
    assert [type(m) for m in objective.update_masks] == [OffPolicySequenceMask, HighEntropyMask]
    with_router = PolicyObjective(RouterShiftGate(), SequenceMean(), kl=KLPenalty(), masks=[HighEntropyMask()])
    assert with_router.requires == {"router_logp", "old_router_logp", "ref_logp"}
    topk = PolicyObjective(DivergenceMaskGate(mode="topk_tv", threshold=0.1), TokenMean())
    assert topk.requires == {"topk_logp", "old_topk_logp"}
    assert PolicyObjective(NoGate(), TokenMean(), token_weights=[ReferenceProbWeight()]).requires == {"ref_logp"}
    assert PolicyObjective(NoGate(), TokenMean(), token_weights=[ReadsRolloutLogp()]).requires == {"rollout_logp"}


class ReadsRolloutLogp(TokenWeight):
    """A token weight of a user's that reads the engine's log-probs (the trainer computes them when asked)."""

    requires = frozenset({"rollout_logp"})

    def __call__(self, mask, *, rollout_logp):
        return mask * rollout_logp.exp()


class ReadsReferenceAndTeacher(NoGate):
    """A gate of a user's that reads the reference's and the teacher's log-probs (the trainer computes both)."""

    requires = frozenset({"ref_logp", "teacher_logp"})

    def __call__(self, logp, old_logp, adv, mask, *, ref_logp, teacher_logp):
        self.seen = (ref_logp, teacher_logp)
        return super().__call__(logp, old_logp, adv, mask)


def test_a_gate_requiring_the_reference_and_teacher_log_probs_is_given_them():
    gate, logp = ReadsReferenceAndTeacher(), torch.zeros(2, 3, requires_grad=True)
    objective = PolicyObjective(gate, TokenMean())
    assert objective.requires == {"ref_logp", "teacher_logp"}
    ref, teacher = torch.full((2, 3), -1.0), torch.full((2, 3), -2.0)
    objective(logp, logp.detach(), torch.ones(2, 3), torch.ones(2, 3), ref_logp=ref, teacher_logp=teacher)
    assert gate.seen[0] is ref and gate.seen[1] is teacher


def test_requires_given_as_a_string_is_refused_naming_the_part():
    class OneString(NoGate):
        requires = "ref_logp"

    with pytest.raises(TypeError, match=r"OneString\.requires='ref_logp' must be a frozenset of input names"):
        PolicyObjective(OneString(), TokenMean())


# Two completions, three positions. NoGate (loss -A log pi) makes the reference easy to write by hand.
#   row 0: A = -1, log(pi / pi_old) = (-0.6, -0.6, -0.6): mean log(pi_old / pi) = 0.6 > 0.5 -> masked per update
#   row 1: A = +2, two tokens, log-ratios (0.1, -0.1)
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def two_rows():
    mask = torch.tensor(MASK, dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -math.inf]], dtype=torch.float64)
    ratio = torch.tensor([[-0.6, -0.6, -0.6], [0.1, -0.1, math.nan]], dtype=torch.float64)
    logp = (old + ratio).requires_grad_(True)
    adv = torch.tensor([[-1.0] * 3, [2.0, 2.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, math.nan]], dtype=torch.float64)
    return mask, old, logp, adv, ref


def test_a_per_update_mask_drops_the_surrogate_but_keeps_the_kl_term_and_the_normaliser():
    mask, old, logp, adv, ref = two_rows()
    objective = PolicyObjective(
        NoGate(), TokenMean(), kl=KLPenalty(beta=0.1, estimator="k1"), masks=[OffPolicySequenceMask(threshold=0.5)]
    )
    loss, metrics = objective(logp, old, adv, mask, ref_logp=ref)
    # by hand over the 5 real tokens: row 0 keeps only 0.1 * (log pi - log pi_ref); row 1 has -2 log pi + 0.1 k1
    lp = logp.detach()
    row0 = sum(0.1 * (lp[0, t] - ref[0, t]) for t in range(3))
    row1 = sum(-2 * lp[1, t] + 0.1 * (lp[1, t] - ref[1, t]) for t in range(2))
    assert loss.item() == pytest.approx(((row0 + row1) / 5).item())  # still over 5 tokens, not 2
    expected = torch.tensor([[0.1, 0.1, 0.1], [-1.9, -1.9, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(grad_of(loss, logp), expected)
    assert metrics["mask/off_policy_frac"].item() == pytest.approx(3 / 5)


def test_the_gate_sees_only_the_kept_tokens():
    # HighEntropyMask(quantile=0.5) over entropies (0.1, 0.2, 0.3 | 0.9, 0.8): threshold the median 0.3 keeps
    # (0, 2), (1, 0) and (1, 1); the clip metrics then count 3 tokens
    mask, old, logp, adv, _ = two_rows()
    entropy = torch.tensor([[0.1, 0.2, 0.3], [0.9, 0.8, math.nan]], dtype=torch.float64)
    objective = PolicyObjective(
        ClipGate(clip_low=0.2, clip_high=0.2), SequenceMean(), masks=[HighEntropyMask(quantile=0.5)]
    )
    loss, metrics = objective(logp, old, adv, mask, entropy=entropy)
    # row 0 token 2: A = -1, r = e^-0.6 = 0.549 < 0.8 -> clipped, no gradient; row 1: r = e^+-0.1 inside [0.8, 1.2]
    g = grad_of(loss, logp)
    assert (g[0] == 0).all()  # tokens 0, 1 masked; token 2 clipped
    r = torch.exp(torch.tensor([0.1, -0.1], dtype=torch.float64))
    torch.testing.assert_close(g[1, :2], -2 * r / 2 / 2)  # -A r / |o_1| / G with the full length and both rows
    assert metrics["clip/low_frac"].item() == pytest.approx(1 / 3)


def test_step_masks_shrink_the_loss_mask_before_the_normaliser():
    mask, old, _, adv, _ = two_rows()
    rollout = old.clone()
    train = rollout + torch.tensor([[0.0, math.log(6.0), 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)  # k = 6 at (0, 1)
    objective = PolicyObjective(NoGate(), TokenMean(), masks=[MismatchBandMask(), HighEntropyMask(quantile=1.0)])
    stepped, metrics = objective.step_mask(mask, adv, train_logp=train, rollout_logp=rollout)
    assert stepped.dtype == mask.dtype and stepped.tolist() == [[1, 0, 1], [1, 1, 0]]
    assert metrics["mask/mismatch_frac"].item() == pytest.approx(1 / 5)
    assert objective.aggregator.normaliser(stepped).item() == 4  # the dropped token left the normaliser
    # per-update masks are not step masks: with no step mask the mask comes back unchanged
    assert torch.equal(PolicyObjective(NoGate(), TokenMean()).step_mask(mask, adv)[0], mask)


def test_distillation_shapes_the_advantage_the_gate_sees():
    mask, old, logp, adv, _ = two_rows()
    teacher = torch.tensor([[-1.5, -2.0, -1.0], [-1.0, -1.0, math.nan]], dtype=torch.float64)
    objective = PolicyObjective(NoGate(), TokenMean(), distill=TeacherKL(coef=0.5))
    loss, metrics = objective(logp, old, adv, mask, teacher_logp=teacher)
    # NoGate: gradient -(A - 0.5 (log pi - log pi_teacher)) / 5 on real tokens
    lp = logp.detach()
    expected = torch.where(mask > 0, -(adv - 0.5 * (lp - teacher)) / 5, torch.zeros_like(lp))
    torch.testing.assert_close(grad_of(loss, logp), expected)
    assert "distill/reverse_kl" in metrics
    with pytest.raises(ValueError, match="teacher_logp"):
        objective(logp, old, adv, mask)


def test_missing_inputs_are_named_and_extra_ones_ignored():
    mask, old, logp, adv, _ = two_rows()
    with pytest.raises(ValueError, match=r"HighEntropyMask needs \['entropy'\]"):
        PolicyObjective(NoGate(), TokenMean(), masks=[HighEntropyMask()])(logp, old, adv, mask)
    with pytest.raises(ValueError, match="RouterShiftGate needs"):
        PolicyObjective(RouterShiftGate(), TokenMean())(logp, old, adv, mask)
    # step inputs handed to every pass (as the trainer slices them) do not reach a gate that does not read them
    loss, _ = PolicyObjective(ClipGate(), TokenMean())(logp, old, adv, mask, train_logp=old, rollout_logp=old)
    assert torch.isfinite(loss)


def test_adaptive_entropy_state_lives_in_the_objective():
    objective = PolicyObjective(NoGate(), TokenMean(), entropy=EntropyBonus(adaptive=AdaptiveEntropy(target=1.0)))
    assert objective.entropy is not None  # coef 0 but adaptive: the bonus is on
    assert objective.end_step({"loss": 1.0}) == {}  # nothing measured (no update ran): nothing moves
    assert objective.end_step({"entropy": torch.tensor(0.5)}) == {"entropy/coef": pytest.approx(0.005)}
    state = objective.state_dict()
    assert state == {"entropy": {"value": pytest.approx(0.005), "entropy": 0.5}}
    fresh = PolicyObjective(NoGate(), TokenMean(), entropy=EntropyBonus(adaptive=AdaptiveEntropy(target=1.0)))
    fresh.load_state_dict(state)
    assert fresh.entropy.current == objective.entropy.current == pytest.approx(0.005)
    constant = PolicyObjective(NoGate(), TokenMean(), entropy=EntropyBonus(coef=0.01))
    assert constant.end_step({"entropy": 0.5}) == {} and constant.state_dict() == {}
    assert PolicyObjective(NoGate(), TokenMean(), entropy=EntropyBonus()).entropy is None


def test_part_names_list_what_computes_the_loss_in_order_and_leave_out_what_is_off():
    """What a non-finite loss with finite inputs is blamed on: the parts the objective holds, none it switched off."""
    objective = PolicyObjective(
        ClipGate(), TokenMean(), kl=KLPenalty(beta=0.0), entropy=EntropyBonus(coef=0.01),
        masks=[HighEntropyMask(), MismatchBandMask()], token_weights=[OverlongFilter()],
    )  # fmt: skip
    assert objective.part_names == [  # the KL term is off (beta 0); the step mask before the per-update one
        "gate ClipGate", "aggregator TokenMean", "entropy EntropyBonus", "mask MismatchBandMask",
        "mask HighEntropyMask", "token weight OverlongFilter",
    ]  # fmt: skip
