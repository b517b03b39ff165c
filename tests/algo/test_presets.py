import logging

import pytest

from gpo.algo import (
    ALGORITHMS,
    AlgorithmKnobs,
    BatchWhitenedAdvantage,
    CISPOGate,
    ClipGate,
    ConstantNorm,
    GeometricMeanGate,
    GroupNormAdvantage,
    LeaveOneOutAdvantage,
    NoGate,
    RouterShiftGate,
    SequenceClipGate,
    SequenceMean,
    SoftGate,
    TokenMean,
    build_algorithm,
)

EXPECTED_PARTS = {
    "grpo": (GroupNormAdvantage, NoGate, SequenceMean),
    "rloo": (LeaveOneOutAdvantage, NoGate, SequenceMean),
    "reinforce_pp": (BatchWhitenedAdvantage, NoGate, SequenceMean),
    "dr_grpo": (GroupNormAdvantage, NoGate, TokenMean),
    "dapo": (GroupNormAdvantage, ClipGate, TokenMean),
    "cispo": (GroupNormAdvantage, CISPOGate, TokenMean),
    "gspo": (GroupNormAdvantage, SequenceClipGate, SequenceMean),
    "sapo": (GroupNormAdvantage, SoftGate, SequenceMean),
    "gmpo": (GroupNormAdvantage, GeometricMeanGate, SequenceMean),
    "rspo": (GroupNormAdvantage, RouterShiftGate, SequenceMean),
}


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_preset_builds_its_parts(name):
    algo = build_algorithm(name)
    assert tuple(map(type, (algo.advantage, algo.gate, algo.aggregator))) == EXPECTED_PARTS[name]


def test_defaults_from_the_seed_configs():
    assert build_algorithm("grpo").advantage.scale == "group"
    assert build_algorithm("dr_grpo").advantage.scale == "none"
    cispo = build_algorithm("cispo").gate
    assert (cispo.clip_low, cispo.clip_high) == (0.4, 0.5)
    gspo = build_algorithm("gspo").gate
    assert (gspo.clip_low, gspo.clip_high) == (0.4, 0.5)
    sapo = build_algorithm("sapo").gate
    assert (sapo.tau_pos, sapo.tau_neg) == (1.0, 1.05)
    dapo = build_algorithm("dapo").gate
    assert (dapo.clip_low, dapo.clip_high) == (0.2, 0.28)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "dr_grpo"])
def test_ppo_clip_layers_on_the_reinforce_family(name):
    gate = build_algorithm(name, AlgorithmKnobs(use_ppo_clip=True, clip_low=0.2, clip_high=0.3)).gate
    assert isinstance(gate, ClipGate) and (gate.clip_low, gate.clip_high) == (0.2, 0.3)


@pytest.mark.parametrize("name", ["cispo", "gspo", "sapo", "gmpo", "rspo"])
def test_ppo_clip_refused_where_the_algorithm_has_its_own_ratio_handling(name):
    with pytest.raises(ValueError, match=f"use_ppo_clip=True is not compatible with algorithm='{name}'"):
        build_algorithm(name, AlgorithmKnobs(use_ppo_clip=True))


def test_rloo_refuses_batch_normalisation():
    with pytest.raises(ValueError, match=r"rloo.*advantage_norm='group'"):
        build_algorithm("rloo", AlgorithmKnobs(advantage_norm="batch"))


def test_reinforce_pp_forces_batch_normalisation_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        algo = build_algorithm("reinforce_pp", AlgorithmKnobs(advantage_norm="group"))
    assert isinstance(algo.advantage, BatchWhitenedAdvantage)
    assert "advantage_norm set to 'batch'" in caplog.text


def test_grpo_batch_normalisation():
    assert build_algorithm("grpo", AlgorithmKnobs(advantage_norm="batch")).advantage.scale == "batch"


def test_dr_grpo_token_sum_norm_needs_the_generation_budget():
    with pytest.raises(ValueError, match="set max_completion_length"):
        build_algorithm("dr_grpo", AlgorithmKnobs(dr_grpo_loss_agg_mode="token_sum_norm"))
    agg = build_algorithm(
        "dr_grpo", AlgorithmKnobs(dr_grpo_loss_agg_mode="token_sum_norm", max_completion_length=256)
    ).aggregator
    assert isinstance(agg, ConstantNorm) and agg.max_length == 256


@pytest.mark.parametrize(
    ("name", "knobs", "message"),
    [
        ("grpo", AlgorithmKnobs(group_size=1), "group_size=1"),
        ("ppo", AlgorithmKnobs(), "grpo, rloo, reinforce_pp, dr_grpo, dapo, cispo, gspo, sapo, gmpo, rspo"),
        ("grpo", AlgorithmKnobs(use_ppo_clip=True, clip_low=-0.1), "does not contain 1"),
        ("dapo", AlgorithmKnobs(clip_high=-0.5), "does not contain 1"),
        ("grpo", AlgorithmKnobs(advantage_norm="global"), "'group' or 'batch'"),
        ("dr_grpo", AlgorithmKnobs(dr_grpo_loss_agg_mode="seq_mean"), "'token_mean' or 'token_sum_norm'"),
        ("sapo", AlgorithmKnobs(sapo_tau_pos=0), "tau_pos=0"),
    ],
)
def test_invalid_configurations_fail_at_construction_with_the_fix(name, knobs, message):
    with pytest.raises(ValueError, match=message):
        build_algorithm(name, knobs)
