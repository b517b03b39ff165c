import re
from typing import ClassVar

import pytest
import torch

from gpo.algo import StepRewards
from gpo.envs import Environment, NumberGuess, Step
from gpo.models.scorer import score_tokens
from gpo.rollout import HFEngine, MultiTurnEngine, RolloutEngine, Sampling
from gpo.rollout.base import concat_rollouts
from gpo.testing import char_tokenizer, tiny_model


class Recording(RolloutEngine):
    """An engine that remembers what the wrapped engine sampled in each call."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine, self.calls = engine, []

    def setup(self, policy, tokenizer) -> None:
        self.engine.setup(policy, tokenizer)

    def generate(self, prompt_ids, n, **kwargs):
        rollout = self.engine.generate(prompt_ids, n, **kwargs)
        self.calls.append(
            [
                ids[mask.bool()].tolist()
                for ids, mask in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
            ]
        )
        return rollout


class Echo(Environment):
    """Answers every action with a fixed text and a reward per turn; never done. Records its seeds."""

    seeds: ClassVar[list] = []

    def __init__(self, *, rewards=(0.0, 0.5, 1.0), observation: str = "ok\n") -> None:
        self.rewards, self.observation, self.turn = rewards, observation, 0

    def reset(self, seed, task):
        Echo.seeds.append((seed, task))
        return "go\n"

    def step(self, action):
        self.turn += 1
        return Step(self.observation, self.rewards[self.turn - 1], False, {})


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("llama", seed=0), char_tokenizer()


def engine(model_and_tokenizer, env, **kwargs):
    inner = Recording(HFEngine(sampling=Sampling(max_new_tokens=3, temperature=1.0)))
    e = MultiTurnEngine(engine=inner, env=env, **kwargs)
    e.setup(*model_and_tokenizer)
    return e, inner


def test_token_ids_are_the_turns_concatenated_and_only_policy_tokens_train(model_and_tokenizer):
    _, tok = model_and_tokenizer
    e, inner = engine(model_and_tokenizer, Echo(), max_turns=3)
    rollout = e.generate([tok("hi:").input_ids, tok("abc").input_ids], 2, seed=1)
    assert len(inner.calls) == 3 and all(len(call) == 4 for call in inner.calls)  # never done: 3 turns x 4 episodes
    start, between = tok("go\n").input_ids, tok("ok\n").input_ids
    for row in range(4):
        policy = [call[row] for call in inner.calls]
        # first observation, then turn, observation, turn, observation, turn (the last observation is not appended)
        expected = start + policy[0] + between + policy[1] + between + policy[2]
        real = rollout.completion_mask[row].bool()
        assert rollout.completion_ids[row][real].tolist() == expected
        assert rollout.completion_mask[row].sum() == len(expected)  # attention covers policy and env tokens
        trains = [0] * len(start) + [1] * len(policy[0]) + [0] * len(between) + [1] * len(policy[1])
        trains += [0] * len(between) + [1] * len(policy[2])
        assert rollout.loss_mask[row][: len(expected)].tolist() == trains  # no environment token trains
        assert rollout.loss_mask[row][len(expected) :].sum() == 0  # nor padding
    assert rollout.fields["env_return"] == [1.5] * 4 and rollout.fields["turn_rewards"][0] == [0.0, 0.5, 1.0]
    assert rollout.truncated.all() and rollout.group.tolist() == [0, 0, 1, 1]
    assert [t["observation"] for t in rollout.fields["turns"][0]] == ["ok\n"] * 3


def test_logprobs_are_the_samplers_on_policy_tokens_and_match_the_trainer(model_and_tokenizer):
    model, tok = model_and_tokenizer
    e, _ = engine(model_and_tokenizer, NumberGuess(), max_turns=3)
    rollout = e.generate([tok("guess 1-8:").input_ids] * 2, 3, seed=0)
    policy = rollout.loss_mask.bool()
    assert torch.all(rollout.logp[~policy] == 0) and torch.all(rollout.logp[policy] < 0)
    # the trainer scores the whole transcript at once: same ids, same contexts, so the same log-probs
    scored = score_tokens(model, rollout.input_ids, rollout.attention_mask, rollout.completion_ids.shape[1])
    torch.testing.assert_close(scored.logp[policy], rollout.logp[policy], atol=1e-5, rtol=1e-5)


def test_a_group_plays_one_episode_seed_and_episodes_stop_when_done(model_and_tokenizer):
    _, tok = model_and_tokenizer
    Echo.seeds = []
    e, _ = engine(model_and_tokenizer, Echo(), max_turns=1)
    e.generate([tok("p").input_ids, tok("q").input_ids], 3, seed=5)
    seeds = [s for s, _ in Echo.seeds]
    assert seeds[:3] == [seeds[0]] * 3 and seeds[3:] == [seeds[3]] * 3 and seeds[0] != seeds[3]
    assert [task for _, task in Echo.seeds] == ["p"] * 3 + ["q"] * 3
    e.generate([tok("p").input_ids], 1, seed=5)
    assert Echo.seeds[-1][0] == seeds[0]  # reproducible from the seed

    class WinsAtOnce(Echo):
        def step(self, action):
            return Step("bye\n", 2.0, True, {})

    e, inner = engine(model_and_tokenizer, WinsAtOnce(), max_turns=4)
    rollout = e.generate([tok("p").input_ids], 2, seed=0)
    assert len(inner.calls) == 1 and rollout.fields["env_done"] == [True, True] and not rollout.truncated.any()


def test_step_reward_modes(model_and_tokenizer):
    _, tok = model_and_tokenizer
    e, inner = engine(model_and_tokenizer, Echo(), max_turns=3)
    rollout = e.generate([tok("p").input_ids], 2, seed=0)
    assert rollout.turn_rewards.tolist() == [[0.0, 0.5, 1.0]] * 2  # Echo: each turn's step reward
    for row in range(2):  # every policy token knows its turn, environment tokens are -1
        turns = [turn for turn, call in enumerate(inner.calls) for _ in call[row]]
        assert rollout.turn_index[row][rollout.loss_mask[row].bool()].tolist() == turns
        assert (rollout.turn_index[row][~rollout.loss_mask[row].bool()] == -1).all()
    # Both episodes get rewards 0, .5, 1. decision_stepwise: credit = reward, group mean .5; beta 2: -1, 0, +1.
    # env_sparse: credit = reward-to-go 1.5, 1.5, 1, group mean 4/3; beta 3: .5, .5, -1.
    for mode, beta, per_turn in (("decision_stepwise", 2.0, [-1.0, 0.0, 1.0]), ("env_sparse", 3.0, [0.5, 0.5, -1.0])):
        adv = StepRewards(mode=mode, beta=beta)(rollout.turn_rewards, rollout.group, rollout.turn_index)
        for row in range(2):
            expected = [v for turn, v in enumerate(per_turn) for _ in inner.calls[turn][row]]  # each turn's tokens
            values = adv[row][rollout.loss_mask[row].bool()]
            torch.testing.assert_close(values, torch.tensor(expected), atol=1e-6, rtol=0)
            assert torch.all(adv[row][~rollout.loss_mask[row].bool()] == 0)


def test_select_and_concat_keep_the_loss_mask_and_the_turn_records(model_and_tokenizer):
    _, tok = model_and_tokenizer
    e, _ = engine(model_and_tokenizer, Echo(), max_turns=2)
    rollout = e.generate([tok("p").input_ids, tok("qq").input_ids], 2, seed=0)
    picked = rollout.select([3, 0])
    assert torch.equal(picked.loss_mask, rollout.loss_mask[[3, 0]])
    assert torch.equal(picked.turn_index, rollout.turn_index[[3, 0]])
    joined = concat_rollouts([rollout, picked])
    assert (
        torch.equal(joined.loss_mask[4:], picked.loss_mask) and joined.turn_index.shape == joined.completion_ids.shape
    )
    torch.testing.assert_close(joined.turn_rewards[4:], picked.turn_rewards, equal_nan=True)
    assert torch.equal(rollout.to("cpu").loss_mask, rollout.loss_mask)


def test_bad_settings():
    with pytest.raises(ValueError, match="max_turns=0"):
        MultiTurnEngine(engine=HFEngine(), env=NumberGuess(), max_turns=0)
    with pytest.raises(ValueError, match="max_concurrent_rollouts=0"):
        MultiTurnEngine(engine=HFEngine(), env=NumberGuess(), max_concurrent_rollouts=0)
    with pytest.raises(TypeError):
        MultiTurnEngine(engine=HFEngine(), env=NumberGuess(), step_rewards_mode="dense")  # now gpo.algo.StepRewards


def test_a_kl_penalty_in_the_reward_sums_over_the_policys_tokens_only(model_and_tokenizer):
    """The environment's observations are context the policy never chose: its KL to the reference there is not the
    policy's to pay. Written out: ``-beta sum_t k3_t`` over ``loss_mask``, from the two models' log-probs."""
    from gpo.algo import ClipGate, KLPenalty, PolicyObjective, TokenMean
    from gpo.algo.regularizers import kl_estimate
    from gpo.models.scorer import TokenScorer
    from gpo.train.learner import Learner
    from gpo.train.optimization import Optimization

    policy, tok = model_and_tokenizer
    reference = tiny_model("llama", seed=1)  # another model: a KL above 0 on every token
    e, _ = engine(model_and_tokenizer, Echo(observation="a longer observation\n"), max_turns=2)
    rollout = e.generate([tok("hi:").input_ids], 2, seed=0)
    assert (rollout.loss_mask.sum(-1) < rollout.completion_mask.sum(-1)).all()  # observations in the transcript
    rollout.reward = torch.zeros(len(rollout))
    scorer = TokenScorer(policy, reference=reference)
    kl = KLPenalty(beta=0.5, placement="reward")
    learner = Learner(scorer, PolicyObjective(ClipGate(), TokenMean()), Optimization(), kl=kl)
    penalised = learner.add_kl_penalty(rollout).reward
    width = rollout.completion_ids.shape[1]
    logp = score_tokens(policy, rollout.input_ids, rollout.attention_mask, width).logp
    k3 = kl_estimate(logp.double(), scorer.reference_logp(rollout).double(), "k3")
    expected = -0.5 * (k3 * rollout.loss_mask).sum(-1)
    torch.testing.assert_close(penalised.double(), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (("ok", 0.5, "false", {}), r"Answers.step returned done='false' must be True or False"),
        (("ok", "1.0", False, {}), r"reward='1.0' must be a finite number"),
        (("ok", True, False, {}), r"reward=True must be a finite number"),
        (("ok", float("nan"), False, {}), r"reward=nan must be a finite number"),
        ((None, 0.0, False, {}), r"observation=None must be a str"),
        (("ok", 0.0, False, "x"), r"info='x' must be a dict"),
        (("ok", 0.0), r"Answers.step returned \('ok', 0.0\); return gpo.envs.Step\(observation, reward, done, info\)"),
    ],
)
def test_a_step_answer_that_is_not_a_step_is_refused_naming_the_field(model_and_tokenizer, answer, message):
    # done="false" would read as true (the episode ending after one turn); a reward "1.0" as a number
    class Answers(Echo):
        def step(self, action):
            return answer

    e, _ = engine(model_and_tokenizer, Answers(), max_turns=3)
    with pytest.raises(TypeError, match=message):
        e.generate([char_tokenizer()("p").input_ids], 2, seed=0)


@pytest.mark.parametrize("first", [("go\n", {}), None, 7], ids=["gym-style pair", "None", "a number"])
def test_a_first_observation_that_is_not_a_str_is_refused_naming_reset(model_and_tokenizer, first):
    """A gym-style ``(observation, info)`` would enter the context as its repr."""

    class Starts(Echo):
        def reset(self, seed, task):
            return first

    e, _ = engine(model_and_tokenizer, Starts(), max_turns=2)
    with pytest.raises(
        TypeError, match=re.escape(f"Starts.reset returned {first!r}; return the first observation, a str")
    ):
        e.generate([char_tokenizer()("p").input_ids], 2, seed=0)


@pytest.mark.parametrize(
    ("env", "given"),
    [(Echo, "the class Echo"), ("gpo.envs.NumberGuess", "'gpo.envs.NumberGuess'")],
    ids=["class", "import path"],
)
def test_an_env_that_is_no_environment_is_refused_when_the_engine_is_built(env, given):
    wanted = "takes a gpo.envs.base.Environment or a gpo.envs.base.Episodes instance"
    with pytest.raises(TypeError, match=re.escape(f"MultiTurnEngine(env=...) {wanted}; got {given}.")):
        MultiTurnEngine(engine=HFEngine(sampling=Sampling(max_new_tokens=3)), env=env)


def test_a_step_answer_may_hold_numpy_or_tensor_scalars_and_its_info_is_copied(model_and_tokenizer):
    import numpy as np

    class Scalars(Echo):
        info: ClassVar[dict] = {"calls": 0}  # one dict, changed at every step

        def step(self, action):
            self.turn += 1
            Scalars.info["calls"] += 1
            reward = np.float32(0.5) if self.turn == 1 else torch.tensor(0.25)
            return "ok\n", reward, np.bool_(self.turn == 2), Scalars.info

    e, _ = engine(model_and_tokenizer, Scalars(), max_turns=3)
    rollout = e.generate([char_tokenizer()("p").input_ids], 1, seed=0)
    assert rollout.fields["env_return"] == [0.75] and rollout.fields["env_done"] == [True]
    assert [turn["info"]["calls"] for turn in rollout.fields["turns"][0]] == [1, 2]  # each turn's own copy
