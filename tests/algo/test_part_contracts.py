"""A part written by a user that breaks its contract is refused by name: of the wrong kind, a class, a signature
that cannot take the trainer's arguments (when ``Custom`` is built), or an output of the wrong form (at its call)."""

import pytest
import torch

from gpo.algo import (
    AdvantageEstimator,
    ClipGate,
    Custom,
    GroupNormAdvantage,
    HighEntropyMask,
    NoGate,
    OverlongFilter,
    RatioGate,
    SequenceMean,
    TokenMask,
    TokenMean,
    TokenWeight,
)
from gpo.algo.objective import PolicyObjective
from gpo.rollout.base import Rollout
from gpo.train.credit import StepCredit


class NoMask(AdvantageEstimator):
    def __call__(self, reward, group):
        return reward


class PerSequence(AdvantageEstimator):
    def __call__(self, reward, group, mask):
        return reward  # [B], not [B, T]


class NeedsRouter(RatioGate):
    requires = frozenset({"router_logp"})

    def __call__(self, logp, old_logp, adv, mask):  # no router_logp parameter
        return -adv * logp, {}


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"advantage": ClipGate()}, r"Custom\(advantage=ClipGate\(...\)\) takes a gpo.algo.AdvantageEstimator; "
         r"ClipGate is a gpo.algo.RatioGate: did you mean gate=\?"),
        ({"aggregator": GroupNormAdvantage()}, r"takes a gpo.algo.LossAggregator; .* did you mean advantage=\?"),
        ({"gate": "ClipGate"}, r"Custom\(gate='ClipGate'\) takes a gpo.algo.RatioGate\.$"),
        ({"advantage": GroupNormAdvantage}, r"give an instance, GroupNormAdvantage\(...\), not the class"),
        ({"advantage": NoMask()}, r"NoMask.__call__ must take \(reward\[B\], group\[B\], mask\[B, T\]\)"),
        ({"gate": NeedsRouter()}, r"NeedsRouter.__call__ must take \(logp\[B, T\], .*, mask\[B, T\], router_logp=\)"),
    ],
)  # fmt: skip
def test_custom_refuses_a_part_that_cannot_fill_its_slot(parts, message):
    with pytest.raises(TypeError, match=message):
        Custom(**parts)


def test_custom_takes_parts_that_keep_the_contract():
    parts = Custom(advantage=GroupNormAdvantage(), gate=ClipGate(), aggregator=TokenMean()).parts()
    assert isinstance(parts.gate, ClipGate) and isinstance(parts.aggregator, TokenMean)


def step_tensors():
    logp = torch.randn(4, 3, requires_grad=True)
    return logp, logp.detach() - 0.1, torch.randn(4, 3), torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])


class Returns(RatioGate):
    """A gate returning whatever it was built with (the loss from logp by ``loss``)."""

    def __init__(self, loss, metrics=None, pair=True):
        self.loss, self.metrics, self.pair = loss, metrics or {}, pair

    def __call__(self, logp, old_logp, adv, mask):
        loss = self.loss(logp, adv)
        return (loss, self.metrics) if self.pair else loss


@pytest.mark.parametrize(
    ("gate", "message"),
    [
        (Returns(lambda logp, adv: -adv * logp, pair=False), r"Tensor; RatioGate.__call__ returns "
         r"\(per_token_loss\[B, T\], metrics\)"),
        (Returns(lambda logp, adv: (-adv * logp).sum(-1)), r"per_token_loss of shape \[4\]; .* \[B, T\] = \[4, 3\]"),
        (Returns(lambda logp, adv: (-adv * logp).detach()), r"a per_token_loss without gradient \(detached"),
        (Returns(lambda logp, adv: -adv * logp, {"x": 0.5, "y": torch.zeros(4)}), r"metrics \['x', 'y'\] that are "
         r"not 0-d"),
        (Returns(lambda logp, adv: -adv * logp, {"mean": torch.ones((), requires_grad=True) * 2}),
         r"metrics \['mean'\] that carry a gradient; give value.detach\(\)"),
    ],
)  # fmt: skip
def test_a_gate_output_outside_the_contract_is_refused_by_name(gate, message):
    logp, old, adv, mask = step_tensors()
    with pytest.raises(ValueError, match="the ratio gate Returns returned " + message):
        PolicyObjective(gate, SequenceMean())(logp, old, adv, mask)


def test_a_detached_loss_is_not_refused_without_gradient_tracking():
    logp, old, adv, mask = step_tensors()
    with torch.no_grad():
        loss, _ = PolicyObjective(NoGate(), SequenceMean())(logp, old, adv, mask)
    assert loss.ndim == 0


class PerRow(SequenceMean):
    def numerator(self, per_token_loss, mask):
        return (per_token_loss * mask).sum(-1)  # [B], not a scalar


def test_an_aggregator_that_returns_no_scalar_is_refused_by_name():
    logp, old, adv, mask = step_tensors()
    with pytest.raises(ValueError, match=r"the loss aggregator PerRow returned \[4\], not a scalar tensor"):
        PolicyObjective(NoGate(), PerRow())(logp, old, adv, mask)


class Detached(SequenceMean):
    def numerator(self, per_token_loss, mask):
        return super().numerator(per_token_loss, mask).detach()  # the policy would not learn from it


def test_an_aggregator_whose_loss_has_no_gradient_is_refused_by_name():
    logp, old, adv, mask = step_tensors()
    with pytest.raises(ValueError, match=r"the loss aggregator Detached returned a loss without gradient"):
        PolicyObjective(NoGate(), Detached())(logp, old, adv, mask)


def test_a_loss_from_inputs_without_gradient_is_not_refused_for_lacking_one():
    # the objective computed for its values alone (log-probs taken without gradient): nothing to train, nothing wrong
    logp, old, adv, mask = step_tensors()
    loss, _ = PolicyObjective(NoGate(), SequenceMean())(logp.detach(), old, adv, mask)
    assert not loss.requires_grad


def test_an_advantage_of_the_wrong_shape_is_refused_by_name():
    rollout = Rollout(
        prompt_ids=torch.ones(4, 2, dtype=torch.long),
        prompt_mask=torch.ones(4, 2, dtype=torch.long),
        completion_ids=torch.ones(4, 3, dtype=torch.long),
        completion_mask=torch.ones(4, 3, dtype=torch.long),
        truncated=torch.zeros(4, dtype=torch.bool),
        group=torch.tensor([0, 0, 1, 1]),
    )
    rollout.reward = torch.tensor([0.0, 1.0, 1.0, 0.5])
    rollout.scores = rollout.reward[:, None]
    with pytest.raises(ValueError, match=r"PerSequence returned \[4\]; .* adv\[B, T\] = \[4, 3\], one per token"):
        StepCredit(PerSequence(), None)(rollout, rollout.completion_mask.float())


class FloatKeep(TokenMask):
    requires = frozenset({"adv"})

    def __call__(self, mask, *, adv):
        return mask * 1.0, {}  # float, not bool


class PerRowKeep(TokenMask):
    requires = frozenset({"adv"})

    def __call__(self, mask, *, adv):
        return adv[:, 0] > 0, {}  # [B], not [B, T]


class ReadsLogpUnasked(TokenMask):
    def __call__(self, mask, *, logp):  # reads logp without naming it in requires
        return mask > 0, {}


class AsksAdvTakesNone(TokenMask):
    requires = frozenset({"adv"})

    def __call__(self, mask):
        return mask > 0, {}


class DropsWithoutTruncated(TokenWeight):
    requires = frozenset({"truncated"})
    drops_tokens = True

    def __call__(self, mask):
        return mask


class DropsByRef(TokenWeight):
    requires = frozenset({"ref_logp"})
    drops_tokens = True

    def __call__(self, mask, *, ref_logp):
        return mask


class ReadsEntropy(TokenWeight):
    requires = frozenset({"entropy"})  # exists only in a gradient pass

    def __call__(self, mask, *, entropy):
        return mask


class DropsAll(TokenWeight):
    drops_tokens = True  # reads nothing: called with the mask alone

    def __call__(self, mask):
        return mask * 0


class DropsPerRow(TokenWeight):
    requires = frozenset({"truncated"})
    drops_tokens = True

    def __call__(self, mask, *, truncated):
        return (~truncated).float()  # [B], not [B, T]


class UnreadableCall(TokenMask):
    __call__ = staticmethod(print)  # no signature to read: let through


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (FloatKeep(), r"the token mask FloatKeep returned keep of dtype torch.float32 and shape \[4, 3\]; .* one bool "
         r"per token, \[B, T\] = \[4, 3\]"),
        (PerRowKeep(), r"the token mask PerRowKeep returned keep of dtype torch.bool and shape \[4\]"),
    ],
)  # fmt: skip
def test_a_mask_output_outside_the_contract_is_refused_by_name(mask, message):
    _, _, adv, mask_tensor = step_tensors()
    objective = PolicyObjective(NoGate(), SequenceMean(), masks=[mask])
    with pytest.raises(ValueError, match=message):
        objective.step_mask(mask_tensor.float(), adv)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"masks": HighEntropyMask()}, r"masks=HighEntropyMask\(...\) is one part; give a list of parts: "
         r"masks=\[HighEntropyMask\(...\)\]"),
        ({"masks": {HighEntropyMask()}}, r"masks is a set; give a list of parts\.$"),
        ({"masks": [ClipGate()]}, r"masks\[0\]=ClipGate\(...\) takes a gpo.algo.TokenMask; ClipGate is a "
         r"gpo.algo.RatioGate: a gate goes in the algorithm, Custom\(gate=...\)\."),
        ({"masks": [OverlongFilter()]}, r"masks\[0\]=OverlongFilter\(...\) takes .* is a gpo.algo.TokenWeight: did you "
         r"mean token_weights=\?"),
        ({"token_weights": [HighEntropyMask()]}, r"token_weights\[0\]=HighEntropyMask\(...\) takes a "
         r"gpo.algo.TokenWeight; HighEntropyMask is a gpo.algo.TokenMask: did you mean masks=\?"),
        ({"masks": [HighEntropyMask]}, r"masks\[0\]=HighEntropyMask: give an instance, HighEntropyMask\(...\), not "
         r"the class"),
        ({"masks": [ReadsLogpUnasked()]}, r"masks\[0\]=ReadsLogpUnasked\(...\): ReadsLogpUnasked.__call__ must take "
         r"\(mask\): missing a required argument: 'logp'; the keyword arguments are what its requires names\."),
        ({"masks": [AsksAdvTakesNone()]}, r"AsksAdvTakesNone.__call__ must take \(mask, adv=\): got an unexpected "
         r"keyword argument 'adv'"),
        ({"token_weights": [DropsWithoutTruncated()]}, r"DropsWithoutTruncated.__call__ must take \(mask, "
         r"truncated=\)"),
        ({"masks": "HighEntropyMask"}, r"masks is a str; give a list of parts\.$"),
        ({"token_weights": [ReadsEntropy()]}, r"token_weights\[0\]=ReadsEntropy\(...\) requires \['entropy'\], but a "
         r"token weight is fixed for the step before any gradient pass"),
        ({"token_weights": [DropsByRef()]}, r"token_weights\[0\]=DropsByRef\(...\) drops tokens \(drops_tokens = "
         r"True\) and requires \['ref_logp'\], but a dropping weight reads only \['truncated'\]"),
    ],
)  # fmt: skip
def test_token_parts_of_the_wrong_kind_or_signature_are_refused_when_the_objective_is_built(kwargs, message):
    with pytest.raises(TypeError, match=message):
        PolicyObjective(NoGate(), SequenceMean(), **kwargs)


class PerUpdateFloat(TokenMask):
    requires = frozenset({"logp"})  # a per-update mask: checked in each gradient pass

    def __call__(self, mask, *, logp):
        return (logp < 0).float(), {}


class MetricPerToken(TokenMask):
    requires = frozenset({"logp"})

    def __call__(self, mask, *, logp):
        return mask > 0, {"mask/logp": logp}  # [B, T], not one value


class PerRowWeight(TokenWeight):
    def __call__(self, mask):
        return mask.sum(-1)  # [B], not [B, T]


def test_per_update_masks_and_token_weights_are_held_to_their_output_contract():
    logp, old, adv, mask = step_tensors()
    with pytest.raises(ValueError, match=r"the token mask PerUpdateFloat returned keep of dtype torch.float32"):
        PolicyObjective(NoGate(), SequenceMean(), masks=[PerUpdateFloat()])(logp, old, adv, mask)
    with pytest.raises(ValueError, match=r"the token mask MetricPerToken returned metrics \['mask/logp'\] that"):
        PolicyObjective(NoGate(), SequenceMean(), masks=[MetricPerToken()])(logp, old, adv, mask)
    with pytest.raises(ValueError, match=r"the token weight PerRowWeight returned \[4\]; .* \[B, T\] = \[4, 3\]"):
        PolicyObjective(NoGate(), SequenceMean(), token_weights=[PerRowWeight()]).weigh(adv, mask.float())


def test_a_part_whose_call_has_no_signature_to_read_is_let_through():
    assert PolicyObjective(NoGate(), SequenceMean(), masks=[UnreadableCall()]).masks


def test_a_dropping_weight_is_given_what_its_requires_names_and_held_to_its_output():
    mask, truncated = torch.ones(2, 3), torch.tensor([True, False])
    assert torch.equal(PolicyObjective(NoGate(), SequenceMean(), token_weights=[DropsAll()]).loss_mask(mask, truncated),
                       torch.zeros(2, 3))  # fmt: skip
    kept = PolicyObjective(NoGate(), SequenceMean(), token_weights=[OverlongFilter()]).loss_mask(mask, truncated)
    assert torch.equal(kept, torch.tensor([[0.0] * 3, [1.0] * 3]))
    with pytest.raises(ValueError, match=r"the token weight DropsPerRow returned \[2\]; .* \[B, T\] = \[2, 3\]"):
        PolicyObjective(NoGate(), SequenceMean(), token_weights=[DropsPerRow()]).loss_mask(mask, truncated)


def test_custom_refuses_a_gate_whose_requires_is_a_string_before_reading_its_call():
    class OneString(NoGate):
        requires = "ref_logp"

    with pytest.raises(TypeError, match=r"OneString\.requires='ref_logp' must be a frozenset of input names"):
        Custom(gate=OneString())
