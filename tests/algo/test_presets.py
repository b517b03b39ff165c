"""Presets: the parts each one builds, its sources' defaults, its own settings, and the combinations it refuses."""

import pytest

from gpo.algo import (
    ALGORITHMS,
    CISPO,
    DAPO,
    DPPO,
    DRO,
    GMPO,
    GOPO,
    GRPO,
    GSPO,
    PRESETS,
    RLOO,
    RSPO,
    SAPO,
    VESPO,
    BatchWhitenedAdvantage,
    CISPOGate,
    ClipGate,
    ConstantNorm,
    Custom,
    DivergenceMaskGate,
    DrGRPO,
    DROGate,
    GeometricMeanGate,
    GroupNormAdvantage,
    LeaveOneOutAdvantage,
    MaxRL,
    MeanScaledAdvantage,
    NoGate,
    PPOClip,
    RankAdvantage,
    ReinforcePP,
    RouterShiftGate,
    SequenceClipGate,
    SequenceMean,
    SoftGate,
    TokenMean,
    VESPOGate,
    preset,
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
    "vespo": (GroupNormAdvantage, VESPOGate, TokenMean),
    "maxrl": (MeanScaledAdvantage, NoGate, SequenceMean),
    "gopo": (RankAdvantage, ClipGate, SequenceMean),
}


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_preset_builds_its_parts(name):
    parts = preset(name).parts()
    assert tuple(map(type, (parts.advantage, parts.gate, parts.aggregator))) == EXPECTED_PARTS[name]
    assert isinstance(preset(name), ALGORITHMS[name])


def test_defaults_from_the_flat_grpo_configs():
    assert GRPO().parts().advantage.scale == "group"
    assert DrGRPO().parts().advantage.scale == "none"
    assert (CISPO().gate.clip_low, CISPO().gate.clip_high) == (0.4, 0.5)
    assert (GSPO().gate.clip_low, GSPO().gate.clip_high) == (0.4, 0.5)
    assert (SAPO().gate.tau_pos, SAPO().gate.tau_neg) == (1.0, 1.05)
    assert (DAPO().gate.clip_low, DAPO().gate.clip_high) == (0.2, 0.28)
    assert (GMPO().gate.clip_low, RSPO().gate.top_k, RSPO().gate.gamma_min) == (0.4, 2, 0.5)


@pytest.mark.parametrize("algorithm", [GRPO, RLOO, ReinforcePP, DrGRPO])
def test_ppo_clip_layers_on_the_reinforce_family(algorithm):
    gate = algorithm(ppo_clip=PPOClip(clip_low=0.2, clip_high=0.3, dual_clip=3.0)).parts(64).gate
    assert isinstance(gate, ClipGate) and (gate.clip_low, gate.clip_high, gate.dual_clip) == (0.2, 0.3, 3.0)
    gate = algorithm(ppo_clip=PPOClip()).parts(64).gate  # flat GRPO configs' use_ppo_clip defaults: 0.4 / 0.5
    assert isinstance(gate, ClipGate) and (gate.clip_low, gate.clip_high) == (0.4, 0.5)
    assert isinstance(algorithm().parts(64).gate, NoGate)
    with pytest.raises(TypeError, match=r"ppo_clip=True takes gpo.algo.PPOClip\(...\).*ppo_clip: \{\}"):
        algorithm(ppo_clip=True)  # the natural guess in Python


def test_each_preset_reads_only_its_own_settings():
    assert GRPO(advantage_norm="batch").parts().advantage.scale == "batch"
    assert GSPO(per_token_advantage=True).gate.per_token_advantage
    with pytest.raises(TypeError):
        CISPO(ppo_clip=PPOClip())  # CISPO handles the ratio itself: there is no PPO clipping to layer on it
    with pytest.raises(TypeError):
        RLOO(advantage_norm="batch")  # its baseline is a group statistic


def test_presets_of_the_newer_methods_build_their_parts_from_their_own_settings():
    def types(algorithm):
        parts = algorithm.parts(64)
        return tuple(map(type, (parts.advantage, parts.gate, parts.aggregator)))

    assert types(MaxRL()) == (MeanScaledAdvantage, NoGate, SequenceMean)
    assert types(MaxRL(ppo_clip=PPOClip())) == (MeanScaledAdvantage, ClipGate, SequenceMean)
    assert types(DRO(beta=0.05)) == (GroupNormAdvantage, DROGate, TokenMean) and DRO(beta=0.05).gate.beta == 0.05
    assert types(GOPO()) == (RankAdvantage, ClipGate, SequenceMean)
    assert (GOPO().gate.clip_low, GOPO().gate.clip_high) == (0.2, 0.2)
    dppo = DPPO(mode="topk_kl", threshold=0.1, top_k=8)
    assert types(dppo) == (GroupNormAdvantage, DivergenceMaskGate, TokenMean)
    assert (dppo.gate.mode, dppo.gate.threshold, dppo.gate.topk_tokens) == ("topk_kl", 0.1, 8)
    vespo = VESPO(k_pos=1.0, advantage_norm="batch")
    assert (vespo.gate.k_pos, vespo.gate.lambda_pos, vespo.gate.k_neg, vespo.gate.lambda_neg) == (1.0, 3.0, 3.0, 2.0)
    assert vespo.parts().advantage.scale == "batch"
    with pytest.raises(TypeError):
        DRO()  # beta has no default
    with pytest.raises(TypeError):
        DPPO(mode="binary_tv")  # nor has the trust-region radius


def test_dr_grpo_token_sum_norm_divides_by_the_generation_budget():
    assert isinstance(DrGRPO().parts(64).aggregator, TokenMean)
    aggregator = DrGRPO(loss_agg_mode="token_sum_norm").parts(max_new_tokens=64).aggregator
    assert isinstance(aggregator, ConstantNorm) and aggregator.max_length == 64
    assert DrGRPO(loss_agg_mode="token_sum_norm", max_completion_length=256).parts(64).aggregator.max_length == 256
    with pytest.raises(ValueError, match="set max_completion_length"):
        DrGRPO(loss_agg_mode="token_sum_norm").parts(None)


def test_custom_combines_any_parts_without_rules():
    parts = Custom(advantage=RankAdvantage(), gate=VESPOGate(), aggregator=TokenMean()).parts()
    assert tuple(map(type, (parts.advantage, parts.gate, parts.aggregator))) == (RankAdvantage, VESPOGate, TokenMean)
    assert tuple(map(type, Custom().parts().__dict__.values())) == (GroupNormAdvantage, NoGate, SequenceMean)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: preset("ppo"), "grpo, rloo, reinforce_pp, dr_grpo, dapo, cispo, gspo, sapo, gmpo, rspo"),
        (lambda: GRPO(ppo_clip=PPOClip(clip_low=-0.1)), "does not contain 1"),
        (lambda: DAPO(clip_high=-0.5), "does not contain 1"),
        (lambda: GRPO(advantage_norm="global"), "'group' or 'batch'"),
        (lambda: DrGRPO(loss_agg_mode="seq_mean"), "'token_mean' or 'token_sum_norm'"),
        (lambda: DrGRPO(max_completion_length=64), "read only with loss_agg_mode: token_sum_norm"),
        (lambda: SAPO(tau_pos=0), "tau_pos=0"),
        (lambda: RLOO(ppo_clip=PPOClip(dual_clip=0.5)), "dual_clip=0.5 must be > 1"),
        (lambda: DRO(beta=-1), "beta=-1"),
        (lambda: DPPO(mode="tv", threshold=0.1), "'binary_tv', 'binary_kl', 'topk_tv', 'topk_kl'"),
        (lambda: MaxRL(eps=-1), "eps=-1"),
        (lambda: VESPO(advantage_norm="global"), "'group' or 'batch'"),
        (lambda: preset("dro"), "DRO has no default for beta"),
    ],
)
def test_invalid_configurations_fail_at_construction_with_the_fix(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("dapoo", r"'dapoo' is not known; did you mean dapo\? choose a name for a preset's defaults \(grpo, .*gopo\), "
         r"a preset class to change its settings \(GRPO, .*DPPO, DRO\), or Custom"),
        ("Dapo", r"did you mean dapo\?"),
        ("drgrpo", r"'drgrpo' is not known; did you mean dr_grpo\?"),
        ("DrGRPO", r"'DrGRPO' is not known; did you mean dr_grpo\?"),  # the class's name, given as a string
        ("reinforcepp", r"did you mean reinforce_pp\?"),
        ("DAPOO", r"did you mean DAPO\?"),
        ("dro", r"'dro': DRO has no default for beta; choose it by class with its settings: algorithm: "
         r"\{class_path: DRO, init_args: \{beta: ...\}\} \(--config dro sets one\)"),
        ("dppo", r"DPPO has no default for threshold"),
        ("zzz", r"'zzz' is not known; choose a name"),
        # a class given inline on the command line that jsonargparse refused, then took as the union's str
        ("{class_path: Custom, init_args: {gate: {class_path: gpo.algo.GroupNormAdvantage}}}",
         r"is not a name, and as a class it has an error the parser keeps to itself here \(it then read the text as "
         r"a name\): give it as flags \(--model.algorithm Custom --model.algorithm.gate CLASS ...\) or in a YAML file"),
    ],
)  # fmt: skip
def test_an_unknown_or_incomplete_name_is_refused_with_what_to_write(name, says):
    with pytest.raises(ValueError, match=rf"^model.algorithm={says}" if says.startswith("'") else says):
        preset(name)


def test_every_preset_class_is_listed_and_every_defaulted_one_has_a_name():
    import inspect

    from gpo.algo import Algorithm, Custom, presets

    classes = {obj for obj in vars(presets).values() if isinstance(obj, type) and issubclass(obj, Algorithm)}
    assert set(PRESETS) == classes - {Algorithm, Custom} and len(PRESETS) == len(set(PRESETS))
    defaulted = {
        cls for cls in PRESETS if all(p.default is not p.empty for p in inspect.signature(cls).parameters.values())
    }
    assert set(ALGORITHMS.values()) == defaulted
    assert all(name == cls.__name__.lower() or cls in (ReinforcePP, DrGRPO) for name, cls in ALGORITHMS.items())
