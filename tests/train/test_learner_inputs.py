"""The Learner supplies what the objective's parts read (step masks, teacher log-probs, the adaptive entropy
coefficient), and the parts act as their formulas say once inside a training step."""

import copy
import math
from contextlib import nullcontext

import pytest
import torch
from transformers import LlamaForCausalLM

from gpo.algo import ClipGate, EntropyBonus, TokenMean
from gpo.algo.distillation import TeacherKL
from gpo.algo.masks import MismatchBandMask, SecondMomentMask, TokenMask
from gpo.algo.objective import LOSS_TOKENS, MASK_TOKENS, PolicyObjective, combine_statistics
from gpo.algo.regularizers import AdaptiveEntropy
from gpo.models.scorer import TokenScorer
from gpo.models.teacher import LocalTeacher
from gpo.rollout import HFEngine, Sampling
from gpo.testing import char_tokenizer, tiny_config, tiny_model
from gpo.train.learner import Backend, Learner
from gpo.train.optimization import Optimization


def sampled(policy, seed: int = 0):
    """A rollout of 3 prompts x 4 completions of up to 6 tokens from ``policy``, with made-up advantages."""
    tokenizer = char_tokenizer()
    engine = HFEngine(sampling=Sampling(max_new_tokens=6))
    engine.setup(policy, tokenizer)
    rollout = engine.generate([tokenizer.encode(p) for p in ("12 ", "345 ", "6 ")], 4, seed=seed)
    adv = torch.linspace(-1, 1, len(rollout))[:, None] * rollout.completion_mask  # [B, T]
    return rollout, adv


def learner(policy, optim: Optimization | None = None, teacher=None, **objective_kwargs) -> tuple[Learner, Backend]:
    objective = PolicyObjective(ClipGate(), TokenMean(), **objective_kwargs)
    scorer = TokenScorer(policy)
    optim = optim or Optimization(lr=1e-2)
    optimizer, scheduler = optim.build([p for p in policy.parameters() if p.requires_grad], None)
    backend = Backend(optimizer, scheduler, lambda loss: loss.backward(), lambda last: nullcontext(), False,
                      torch.device("cpu"), 0, None)  # fmt: skip
    teacher = LocalTeacher(teacher) if teacher is not None else None
    return Learner(
        scorer, objective, optim, old_logprobs="trainer", sampler_shares_weights=False, teacher=teacher
    ), backend


def assert_same_parameters(a, b):
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, msg=name)


@pytest.mark.parametrize("mask", [MismatchBandMask(low=0.9, high=1.1), SecondMomentMask(bound=0.002)])
def test_a_step_mask_drops_tokens_from_the_loss_and_its_normaliser(mask):
    policy = tiny_model("llama", seed=1)
    rollout, adv = sampled(policy)
    noise = torch.Generator().manual_seed(0)
    rollout.logp = rollout.logp + 0.2 * torch.randn(rollout.logp.shape, generator=noise)  # an engine that disagrees
    masked, plain = policy, copy.deepcopy(policy)

    learner_masked, backend = learner(masked, masks=[mask])
    assert learner_masked.wants_rollout_logprobs  # the mask reads the engine's log-probs, old_logprobs or not
    metrics = learner_masked.update(rollout, adv, rollout.completion_mask.float(), backend)

    # the same update without the mask, on a loss mask with the dropped tokens zeroed by hand
    train_logp = TokenScorer(plain).policy_logp(rollout)
    on = rollout.completion_mask.bool()
    if isinstance(mask, MismatchBandMask):
        ratio = (train_logp - rollout.logp).exp()
        keep = on & (ratio >= 0.9) & (ratio <= 1.1)
    else:  # drop the largest squared log-ratios until the kept mean is within the bound
        squared = ((train_logp.double() - rollout.logp.double()) ** 2)[on]
        ordered = squared.sort().values
        kept_count = max(k for k in range(len(ordered) + 1) if k == 0 or ordered[:k].mean() <= 0.002)
        distance = (train_logp.double() - rollout.logp.double()) ** 2
        keep = on & (distance <= ordered[kept_count - 1]) if kept_count else on & False
    assert 0 < int(keep.sum()) < int(on.sum())  # the case drops some tokens and keeps others
    learner_plain, backend = learner(plain)
    learner_plain.update(rollout, adv, keep.float(), backend)
    assert_same_parameters(masked, plain)
    assert any(key.startswith("mask/") for key in metrics)


def test_distillation_towards_an_identical_teacher_changes_nothing_and_towards_another_shrinks_the_kl():
    student = tiny_model("llama", seed=1)
    rollout, adv = sampled(student)
    before = copy.deepcopy(student)
    identical, backend = learner(student, teacher=copy.deepcopy(student), distill=TeacherKL(replace=True))
    metrics = identical.update(rollout, adv, rollout.completion_mask.float(), backend)
    assert abs(float(metrics["distill/reverse_kl"])) < 1e-6
    assert_same_parameters(student, before)  # a zero advantage everywhere: no gradient

    teacher = tiny_model("llama", seed=2)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(10.0)  # a confident teacher, far from the near-uniform student
    distilling, backend = learner(student, Optimization(lr=3e-2), teacher=teacher, distill=TeacherKL(replace=True))
    kls = []
    for step in range(20):
        rollout, adv = sampled(student, seed=step)
        metrics = distilling.update(rollout, adv, rollout.completion_mask.float(), backend)
        kls.append(float(metrics["distill/reverse_kl"]))
    first, last = sum(kls[:5]) / 5, sum(kls[-5:]) / 5
    assert first > 5 and last < 0.25 * first, kls  # reverse KL falls: the student moves towards the teacher


def test_the_adaptive_entropy_coefficient_follows_each_steps_entropy():
    policy = tiny_model("llama", seed=1)
    rollout, adv = sampled(policy)
    adaptive = AdaptiveEntropy(target=100.0, step=0.01)  # far above any entropy: the coefficient climbs
    steered, backend = learner(policy, entropy=EntropyBonus(adaptive=adaptive))
    coefs = [float(steered.update(rollout, adv, rollout.completion_mask.float(), backend)["entropy/coef"])]
    coefs.append(float(steered.update(rollout, adv, rollout.completion_mask.float(), backend)["entropy/coef"]))
    assert coefs == pytest.approx([0.01, 0.02])
    assert steered.objective.state_dict() == {"entropy": {"value": pytest.approx(0.02), "entropy": adaptive.entropy}}


def test_a_teacher_whose_vocabulary_cannot_hold_the_policys_tokens_is_refused():
    small = LocalTeacher(LlamaForCausalLM(tiny_config("llama", vocab_size=10)))
    with pytest.raises(ValueError, match=r"model.teacher's input embedding has 10 rows .* same family"):
        small.setup(char_tokenizer())
    LocalTeacher(tiny_model("llama")).setup(char_tokenizer())  # the same vocabulary: accepted


def test_step_metrics_over_micro_batches_and_epochs_are_token_means_and_extremes():
    one = {"entropy": torch.tensor(2.0), LOSS_TOKENS: torch.tensor(5.0), MASK_TOKENS: torch.tensor(6.0)}
    assert combine_statistics([one])["entropy"] is one["entropy"]  # one update: as it is

    def stats(tokens, masked, entropy, low, high, **more):
        values = {LOSS_TOKENS: tokens, MASK_TOKENS: masked, "entropy": entropy, "ratio/min": low, "ratio/max": high,
                  "vespo/weight_max": high, **more}  # fmt: skip
        return {key: torch.tensor(float(value)) for key, value in values.items()}

    # micro-batches whose gates keep 6, 0, 3 and 1 of their 8, 4, 3 and 5 mask tokens: the gate statistics of the
    # empty one read 0 and have no say; the statistics over the whole mask (entropy, kl/...) are weighted by the
    # mask's tokens; "clip" only in some
    measured = [stats(6, 8, 1.0, 0.9, 1.1, clip=0.5, **{"kl/mean": 0.1}), stats(0, 4, 3.0, 0.0, 0.0),
                stats(3, 3, 2.0, 0.8, 1.3, clip=1.0), stats(1, 5, 6.0, 1.0, 1.0)]  # fmt: skip
    out = combine_statistics(measured)
    assert out["entropy"].item() == pytest.approx((8 * 1 + 4 * 3 + 3 * 2 + 5 * 6) / 20)
    assert out["kl/mean"].item() == pytest.approx(8 * 0.1 / 20)
    assert out["clip"].item() == pytest.approx((6 * 0.5 + 3 * 1.0) / 10)
    assert out["ratio/min"].item() == pytest.approx(0.8) and out["ratio/max"].item() == pytest.approx(1.3)
    assert out["vespo/weight_max"].item() == pytest.approx(1.3)
    assert out[LOSS_TOKENS].item() == 10 and out[MASK_TOKENS].item() == 20


def test_micro_batch_statistics_are_over_the_tokens_the_per_update_masks_leave():
    """A micro-batch whose rows an OffPolicySequenceMask drops whole has no token in the gate's loss: its ratio
    statistics (0) must not pull the step's down; the entropy, KL and mask statistics, over every token of the loss
    mask, come out as over the whole step too."""
    from gpo.algo import ClipGate, KLPenalty, TokenMean
    from gpo.algo.masks import OffPolicySequenceMask
    from gpo.algo.objective import PolicyObjective

    mask, old = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]), torch.zeros(4, 3)
    logp = torch.full((4, 3), -0.05)
    logp[2:] = -1.0  # rows 2 and 3 far off-policy: masked whole
    logp.requires_grad_()
    adv = torch.tensor([[1.0], [1.0], [-1.0], [-1.0]]).expand(4, 3)
    entropy, ref = torch.arange(12.0).view(4, 3), torch.full((4, 3), -0.5)
    objective = PolicyObjective(ClipGate(), TokenMean(), masks=[OffPolicySequenceMask(threshold=0.5)],
                                kl=KLPenalty(beta=0.1))  # fmt: skip
    _, whole = objective(logp, old, adv, mask, torch.tensor(9.0), entropy=entropy, ref_logp=ref)
    parts = [
        objective(logp[rows], old[rows], adv[rows], mask[rows], torch.tensor(9.0), entropy=entropy[rows],
                  ref_logp=ref[rows])[1]
        for rows in (slice(0, 2), slice(2, 4))
    ]  # fmt: skip
    split = combine_statistics([{k: v.detach() for k, v in part.items()} for part in parts])
    assert set(split) == set(whole)
    for key in set(whole) - {"mask/off_policy_kl_mean"}:  # that one a mean over sequences: weighted by tokens
        assert split[key].item() == pytest.approx(whole[key].item()), key


@pytest.mark.parametrize("parts", [5, 12, 20])
def test_a_step_takes_number_of_minibatches_optimiser_steps_whatever_its_row_count(parts):
    """12 rows into 5 minibatches: 5 updates (sizes 3, 3, 2, 2, 2), not ``chunk``'s 4 of 3; more parts than rows:
    one update per row."""
    policy = tiny_model("llama", seed=1)
    rollout, adv = sampled(policy)
    assert len(rollout) == 12
    split, backend = learner(policy, Optimization(lr=1e-3, number_of_minibatches=parts))
    split.update(rollout, adv, rollout.completion_mask.float(), backend)
    assert backend.scheduler.last_epoch == min(parts, 12)  # one scheduler step per optimiser step


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_the_rollout_correction_weighs_the_engine_mismatch_once(mode):
    """With ``old_logprobs: trainer`` the gates' ratio is ``pi / pi_train`` (1 at the first update) and the correction
    alone weighs ``w = pi_train / pi_rollout``: each token's gradient is ``w`` times the on-policy one, not ``w**2``
    (as when the ratio ``pi / pi_rollout`` already held ``w``: a setting ``check_behaviour_policy`` refuses)."""
    from gpo.algo import RolloutCorrection

    policy = tiny_model("llama", seed=1)
    rollout, _ = sampled(policy)
    rollout.logp = rollout.logp - 0.2  # an engine that finds every sampled token e^0.2 times less likely
    objective = PolicyObjective(ClipGate(), TokenMean())
    correcting = Learner(TokenScorer(policy), objective, Optimization(), old_logprobs="trainer",
                         correction=RolloutCorrection(mode=mode, cap=10.0), sampler_shares_weights=False)  # fmt: skip
    mask = rollout.completion_mask.float()
    inputs, _ = correcting.step_inputs(rollout, mask)
    logp = TokenScorer(policy).policy_logp(rollout).requires_grad_()
    adv = torch.ones_like(mask)
    loss, _ = objective(logp, inputs.pop("old_logp"), adv, mask, mask.sum(), **inputs)
    loss.backward()
    weight = -logp.grad[mask.bool()] * mask.sum()  # d loss / d logp_t = -w_t A_t / N
    torch.testing.assert_close(weight, torch.full_like(weight, math.exp(0.2)))


def test_each_update_trains_its_own_rows_normalised_by_them_and_the_logged_loss_is_the_updates_mean():
    """12 rows, 2 minibatches, 2 epochs, micro-batches of 4 (a minibatch of 6 is 4 + 2): each update's loss is the
    objective over its own rows and columns, normalised by its own tokens; the first epoch takes the rows in order,
    the second a shuffle of them; the logged loss and gradient norm are the means over the 4 updates. At lr 1e-12
    the policy stays put, so each update's ratio is 1 and ClipGate's loss is ``-sum(A * mask) / sum(mask)`` over
    its rows, worked out here from the rollout alone."""
    policy = tiny_model("llama", seed=1)
    rollout, _ = sampled(policy)
    lengths = torch.tensor([1, 2, 3, 4, 5, 6] * 2)  # completions of every width, each update's width its longest
    rollout.completion_mask = rollout.loss_mask = (torch.arange(6) < lengths[:, None]).long()
    mask = rollout.completion_mask.float()
    adv = torch.linspace(-1, 1, 12)[:, None] * mask
    optim = Optimization(lr=1e-12, number_of_minibatches=2, ppo_epochs=2, micro_batch_size=4)
    split, backend = learner(policy, optim)
    updates, minibatch = [], split._minibatch

    def recorded(batch, order, start, stop, backend, measured):
        applied = minibatch(batch, order, start, stop, backend, measured)
        updates.append((order, start, stop, applied))
        return applied

    split._minibatch = recorded
    torch.manual_seed(0)
    metrics = split.update(rollout, adv, mask, backend)
    assert [(start, stop) for _, start, stop, _ in updates] == [(0, 6), (6, 12)] * 2
    assert updates[0][0] is None and updates[1][0] is None  # the first epoch: the rows in order
    order = updates[2][0]
    assert updates[3][0] is order and sorted(order.tolist()) == list(range(12)) and order.tolist() != list(range(12))
    for order, start, stop, (loss, _, gated) in updates:
        rows = torch.arange(12)[start:stop] if order is None else order[start:stop]
        expected = -(adv[rows] * mask[rows]).sum() / mask[rows].sum()
        assert loss.item() == pytest.approx(expected.item(), abs=1e-5), (start, order)
        assert gated == mask[rows].sum()  # no mask dropped any: the gate covered every token of the update
    losses, norms = [float(u[3][0]) for u in updates], [float(u[3][1]) for u in updates]
    assert len(set(losses)) == 4  # the mean differs from any one update's
    assert metrics["loss"].item() == pytest.approx(sum(losses) / 4, abs=1e-6)
    assert metrics["grad/norm"].item() == pytest.approx(sum(norms) / 4, rel=1e-6)


def test_old_logprobs_are_the_engines_or_the_trainers_as_set_and_the_mismatch_is_the_samplers_kl():
    """``old_logprobs: rollout`` keeps the engine's even when a correction has the trainer's computed; ``trainer``
    with more than one update computes them once before the first (with one update alone, the gradient pass's own
    are used); the mismatch KL is KL(sampler || trainer) by the k3 estimate ``r - 1 - log r``, ``r = pi_train /
    pi_rollout``, over the engine's samples: with the engine 0.2 below the trainer on every token, ``e^0.2 - 1.2``."""
    from dataclasses import replace

    from gpo.algo import RolloutCorrection

    policy = tiny_model("llama", seed=1)
    rollout, _ = sampled(policy)
    mask = rollout.completion_mask.float()
    train_logp = TokenScorer(policy).policy_logp(rollout)
    rollout.logp = (train_logp - 0.2) * mask  # an engine that finds every sampled token e^0.2 times less likely
    objective = PolicyObjective(ClipGate(), TokenMean())

    def inputs(optim=None, logp=rollout.logp, **kwargs):
        taught = Learner(TokenScorer(policy), objective, optim or Optimization(), **kwargs)
        return taught.step_inputs(replace(rollout, logp=logp), mask)

    corrected, _ = inputs(old_logprobs="rollout", correction=RolloutCorrection(mode="tis", cap=10.0))
    assert corrected["old_logp"] is rollout.logp
    for optim in (Optimization(number_of_minibatches=2), Optimization(ppo_epochs=2)):
        own, _ = inputs(optim, None, old_logprobs="trainer")
        torch.testing.assert_close(own["old_logp"], train_logp)
    assert "old_logp" not in inputs(None, None, old_logprobs="trainer")[0]
    _, metrics = inputs(old_logprobs="rollout", sampler_shares_weights=False)
    assert metrics["mismatch/abs_diff_max"].item() == pytest.approx(0.2, rel=1e-5)
    assert metrics["mismatch/kl"].item() == pytest.approx(math.exp(0.2) - 1.2, rel=1e-4)


def test_a_kl_penalty_of_beta_0_in_the_reward_leaves_the_rollout_alone():
    """beta 0 disables the term: no reward change, no ``reward_kl`` (whose ``penalty / -beta`` would be NaN)."""
    from gpo.algo import KLPenalty

    policy = tiny_model("llama", seed=1)
    rollout, _ = sampled(policy)
    rollout.reward = torch.linspace(0, 1, len(rollout))
    off = Learner(TokenScorer(policy), PolicyObjective(ClipGate(), TokenMean()), Optimization(),
                  kl=KLPenalty(beta=0.0, placement="reward"))  # fmt: skip
    assert off.add_kl_penalty(rollout).reward_kl is None
    torch.testing.assert_close(rollout.reward, torch.linspace(0, 1, len(rollout)))


class MisspeltInput(TokenMask):
    requires = frozenset({"ref_logps"})

    def __call__(self, mask, *, ref_logps):
        return mask > 0, {}


def test_an_input_the_trainer_does_not_compute_is_refused_naming_the_part_and_the_closest_input():
    with pytest.raises(ValueError, match=r"^MisspeltInput requires 'ref_logps', which the trainer does not compute; "
                                         r"did you mean 'ref_logp'\? it supplies adv, "):  # fmt: skip
        learner(tiny_model("llama", seed=1), masks=[MisspeltInput()])


def test_the_empty_loss_warning_counts_steps_in_a_row_only(caplog):
    """A step that trains resets the streak: 4 empty steps, a trained one, then 4 empty ones is no warning yet."""
    import logging

    taught, _ = learner(tiny_model("llama", seed=1))
    empty, kept = torch.zeros(2, 3), torch.ones(2, 3)
    with caplog.at_level(logging.WARNING, logger="gpo"):
        trained = [taught.has_loss_tokens(mask, step) for step, mask in enumerate([empty] * 4 + [kept] + [empty] * 4)]
        assert trained == [False] * 4 + [True] + [False] * 4 and taught.empty_streak == 4
        assert not [r for r in caplog.records if "no token was left in the loss" in r.getMessage()]
        taught.has_loss_tokens(empty, 9)
    [warning] = [r.getMessage() for r in caplog.records if "no token was left in the loss" in r.getMessage()]
    assert "optimiser step 9" in warning and "for 5 steps in a row" in warning


def test_a_single_on_policy_update_hands_the_gate_old_logprobs_without_grad():
    """With one update and no old log-probs computed, the gate's ``old_logp`` is the gradient pass's own, detached,
    as ``RatioGate`` promises: a custom gate that does not detach it itself still gets ``-A grad log pi``."""

    class Reinforce(ClipGate):
        def __call__(self, logp, old_logp, adv, mask):
            self.old_requires_grad = old_logp.requires_grad
            return -(logp - old_logp).exp() * adv * mask, {}

    policy, gate = tiny_model("llama", seed=1), Reinforce()
    rollout, adv = sampled(policy)
    rollout.logp = None
    before = copy.deepcopy(policy)
    optim = Optimization(lr=1e-2)
    optimizer, scheduler = optim.build(list(policy.parameters()), None)
    backend = Backend(optimizer, scheduler, lambda loss: loss.backward(), lambda last: nullcontext(), False,
                      torch.device("cpu"), 0, None)  # fmt: skip
    on_policy = Learner(TokenScorer(policy), PolicyObjective(gate, TokenMean()), optim, old_logprobs="trainer")
    metrics = on_policy.update(rollout, adv, rollout.completion_mask.float(), backend)
    assert gate.old_requires_grad is False and metrics["grad/norm"].item() > 0
    assert any(not torch.equal(a, b) for a, b in zip(policy.parameters(), before.parameters(), strict=True))


def test_a_step_whose_step_masks_leave_no_token_takes_no_optimiser_step():
    """After a normal update, a step whose engine is 1 nat off everywhere: the band keeps no token. No update at all
    (AdamW's momentum would still move the weights on an empty loss), and the empty step counts into the streak."""
    policy = tiny_model("llama", seed=1)
    taught, backend = learner(policy, masks=[MismatchBandMask(low=0.9, high=1.1)])
    rollout, adv = sampled(policy)
    assert taught.update(rollout, adv, rollout.completion_mask.float(), backend) is not None  # engine == trainer
    before, lr_steps = copy.deepcopy(policy), backend.scheduler.last_epoch
    rollout, adv = sampled(policy, seed=1)
    rollout.logp = rollout.logp - 1.0
    assert taught.update(rollout, adv, rollout.completion_mask.float(), backend) is None
    assert_same_parameters(policy, before)
    assert backend.scheduler.last_epoch == lr_steps and taught.empty_streak == 1


class DropsAbove(TokenMask):
    """A per-update mask (it reads the entropy) keeping the tokens whose entropy is at most ``bound``."""

    requires = frozenset({"entropy"})

    def __init__(self, bound: float) -> None:
        self.bound = bound

    def __call__(self, mask, *, entropy):
        return (mask > 0) & (entropy <= self.bound), {}


def test_steps_whose_per_update_masks_leave_the_gate_no_token_count_into_the_empty_loss_streak(caplog):
    """Such a step trains nothing from its surrogate (only the KL and entropy terms could): it counts like a step the
    step masks empty, a step whose gate covered tokens ends the streak, and the fifth in a row is warned about."""
    import logging

    policy = tiny_model("llama", seed=1)
    taught, backend = learner(policy, masks=[DropsAbove(math.inf)])
    rollout, adv = sampled(policy)
    mask = rollout.completion_mask.float()
    taught.empty_streak = 3
    assert taught.update(rollout, adv, mask, backend)[LOSS_TOKENS] > 0 and taught.empty_streak == 0
    taught.objective.update_masks[0].bound = -1.0  # now every token is dropped
    with caplog.at_level(logging.WARNING, logger="gpo"):
        for step in range(5):
            assert taught.update(rollout, adv, mask, backend)[LOSS_TOKENS] == 0
            assert taught.empty_streak == step + 1
    [warning] = [r.getMessage() for r in caplog.records if "no token was left in the loss" in r.getMessage()]
    assert "for 5 steps in a row" in warning and "DropsAbove" in warning
    assert "OverlongFilter" not in warning and "max_new_tokens" not in warning  # no such part: not the cause


class Normalised(TokenMean):
    """TokenMean with a normaliser of one's own: ``value`` whatever the mask."""

    def __init__(self, value: float) -> None:
        self.value = value

    def normaliser(self, mask):
        return torch.tensor(self.value)


@pytest.mark.parametrize("value", [0.0, -3.0, math.nan, math.inf])
def test_a_normaliser_that_is_not_positive_and_finite_is_refused_naming_the_aggregator(value):
    """The aggregator floors its divisor at 1e-12: a normaliser of 0 would scale the loss up 1e12, unseen (clipping
    hides it in the gradient), and a negative one would turn the loss around."""
    policy = tiny_model("llama", seed=1)
    before = copy.deepcopy(policy)
    taught, backend = learner(policy)
    taught.objective.aggregator = Normalised(value)
    rollout, adv = sampled(policy)
    said = f"the loss aggregator Normalised gave the normaliser {value:g} for a minibatch with tokens in the loss; "
    with pytest.raises(ValueError, match=said + "LossAggregator.normaliser returns"):
        taught.update(rollout, adv, rollout.completion_mask.float(), backend)
    assert_same_parameters(policy, before)  # refused before the optimiser step


def test_a_zero_normaliser_over_an_empty_loss_mask_is_no_error():
    """A minibatch with no token in its loss mask has nothing to divide: TokenMean's normaliser is 0 there."""
    policy = tiny_model("llama", seed=1)
    taught, backend = learner(policy)
    rollout, adv = sampled(policy)
    metrics = taught.update(rollout, adv, torch.zeros_like(rollout.completion_mask, dtype=torch.float), backend)
    assert metrics["loss"] == 0 and metrics[LOSS_TOKENS] == 0
