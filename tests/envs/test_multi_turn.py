import re
from dataclasses import replace
from typing import ClassVar

import pytest
import torch

from gpo.algo import StepRewards
from gpo.envs import Environment, NumberGuess, Step
from gpo.models.scorer import score_tokens
from gpo.rollout import HFEngine, MultiTurnEngine, RolloutEngine, Sampling
from gpo.rollout.base import Rollout, concat_rollouts
from gpo.rollout.multi_turn import episode_seeds
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


class Scripted(RolloutEngine):
    """Answers its ``k``-th call with the token rows ``turns[k]`` (one per context, right-padded), each real token with
    log-prob ``-(row + 1) / 4`` and padding with -9; records the contexts and sampling of each call."""

    def __init__(self, turns: list[list[list[int]]], *, max_new_tokens: int = 4) -> None:
        self.turns, self.calls, self.sampling = list(turns), [], Sampling(max_new_tokens=max_new_tokens)

    def generate(self, prompt_ids, n, *, greedy=False, seed=None, logprobs=True, sampling=None):
        self.calls.append({"contexts": [list(p) for p in prompt_ids], "sampling": sampling})
        rows = self.turns[len(self.calls) - 1]
        width, pad = max(len(r) for r in rows), char_tokenizer().pad_token_id
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        logp = torch.where(mask.bool(), -(torch.arange(len(rows))[:, None] + 1) / 4, -9.0)
        return Rollout(
            torch.zeros((len(rows), 1), dtype=torch.long), torch.ones((len(rows), 1), dtype=torch.long),
            torch.tensor([r + [pad] * (width - len(r)) for r in rows]), mask,
            truncated=torch.zeros(len(rows), dtype=torch.bool), group=torch.arange(len(rows)),
            logp=logp.float() if logprobs else None,
        )  # fmt: skip


def scripted(env, turns, **kwargs):
    e = MultiTurnEngine(engine=Scripted(turns), env=env, **kwargs)
    e.setup(None, char_tokenizer())
    return e


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
    with pytest.raises(ValueError, match=re.escape("observation_template='User: ' must contain '{observation}'")):
        MultiTurnEngine(engine=HFEngine(), env=NumberGuess(), observation_template="User: ")
    wanted = "MultiTurnEngine(engine=...) takes a gpo.rollout.base.RolloutEngine instance; got the class HFEngine."
    with pytest.raises(TypeError, match=re.escape(wanted)):
        MultiTurnEngine(engine=HFEngine, env=NumberGuess())


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
        (("ok", torch.tensor([0.5, 0.5]), False, {}), r"reward=tensor\(\[0.5000, 0.5000\]\) must be a finite number"),
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


def test_a_turn_ended_by_eos_keeps_its_eos_drops_its_padding_and_reaches_the_env_as_text():
    tok = char_tokenizer()
    eos = tok.eos_token_id
    # two episodes of Echo, two turns; row 0 stops at EOS in turn 0, row 1 in turn 1 (the other row runs full)
    turns = [[[*tok("3").input_ids, eos], tok("45").input_ids], [tok("6").input_ids, [*tok("78").input_ids, eos]]]
    e = scripted(Echo(), turns, max_turns=2)
    rollout = e.generate([tok("p").input_ids], 2, seed=0)
    start, between = tok("go\n").input_ids, tok("ok\n").input_ids
    rows = [start + turns[0][0] + between + turns[1][0], start + turns[0][1] + between + turns[1][1]]
    for row, expected in enumerate(rows):  # 3 + 2 + 3 + 1 = 9 and 3 + 2 + 3 + 3 = 11 tokens: no padding inside
        assert rollout.completion_ids[row][: len(expected)].tolist() == expected
        assert rollout.completion_mask[row].sum() == len(expected)
    # policy tokens (EOS included) train and carry the sampler's log-prob, -1/4 on row 0 and -2/4 on row 1
    assert rollout.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]]
    assert rollout.logp.tolist() == [
        [0, 0, 0, -0.25, -0.25, 0, 0, 0, -0.25, 0, 0],
        [0, 0, 0, -0.5, -0.5, 0, 0, 0, -0.5, -0.5, -0.5],
    ]
    # the environment reads the decoded text, EOS left out
    assert [[t["action"] for t in turns] for turns in rollout.fields["turns"]] == [["3", "6"], ["45", "78"]]
    # the second turn's context: prompt, first observation, the first turn (with its EOS), the observation
    assert e.engine.calls[1]["contexts"][0] == tok("p").input_ids + start + turns[0][0] + between


def test_without_logprobs_the_rollout_has_none():
    tok = char_tokenizer()
    e = scripted(Echo(), [[tok("1").input_ids]], max_turns=1)
    assert e.generate([tok("p").input_ids], 1, seed=0, logprobs=False).logp is None


def test_an_episodes_sampling_keeps_each_turn_to_the_wrapped_engines_budget():
    tok = char_tokenizer()
    e = scripted(Echo(), [[tok("1").input_ids]] * 3, max_turns=3)
    assert e.sampling.max_new_tokens == 12  # 4 per turn x 3 turns
    e.generate([tok("p").input_ids], 1, seed=0, sampling=replace(e.sampling, temperature=0.5))
    assert [(c["sampling"].max_new_tokens, c["sampling"].temperature) for c in e.engine.calls] == [(4, 0.5)] * 3


def test_the_given_tasks_reach_the_environment_not_the_decoded_prompts():
    tok = char_tokenizer()
    Echo.seeds = []
    e = scripted(Echo(), [[tok("1").input_ids] * 3], max_turns=1)
    e.generate([tok("p").input_ids, tok("q").input_ids], 1, seed=0, tasks=["task one", "task two"])
    assert [task for _, task in Echo.seeds] == ["task one", "task two"]


def test_observations_enter_the_context_through_the_template_and_an_empty_one_not_at_all():
    tok = char_tokenizer()

    class StartsSilent(Echo):
        def reset(self, seed, task):
            return ""

    e = scripted(StartsSilent(), [[tok("1").input_ids]] * 2, max_turns=2, observation_template="[{observation}]")
    rollout = e.generate([tok("p").input_ids], 1, seed=0)
    expected = tok("1").input_ids + tok("[ok\n]").input_ids + tok("1").input_ids  # no "[]" for the empty first one
    assert rollout.completion_ids[0].tolist() == expected
    assert rollout.loss_mask[0].tolist() == [1, 0, 0, 0, 0, 0, 1]  # 1 + len("[ok\n]") = 5 + 1


class AddsBos:
    """The character tokenizer, putting a BOS token first unless asked not to add special tokens (as Llama's does)."""

    def __init__(self):
        self.inner = char_tokenizer()

    def __call__(self, text, add_special_tokens=True, **kwargs):
        encoded = self.inner(text, **kwargs)
        if add_special_tokens:
            encoded["input_ids"] = [self.inner.eos_token_id, *encoded["input_ids"]]
        return encoded

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_observation_gets_no_bos_token_from_a_tokenizer_that_adds_one():
    tok = char_tokenizer()
    e = MultiTurnEngine(engine=Scripted([[tok("1").input_ids]] * 2), env=Echo(), max_turns=2)
    e.setup(None, AddsBos())
    rollout = e.generate([tok("p").input_ids], 1, seed=0)
    observations, action = (tok("go\n").input_ids, tok("ok\n").input_ids), tok("1").input_ids  # reset's, step's
    assert rollout.completion_ids[0].tolist() == observations[0] + action + observations[1] + action


def test_an_episode_done_before_max_turns_ends_at_its_last_action_with_nan_rewards_after():
    tok = char_tokenizer()

    class WinsOnSecond(Echo):
        def step(self, action):
            self.turn += 1
            return Step("bye\n" if self.turn == 2 else "ok\n", float(self.turn), self.turn == 2, {})

    e = scripted(WinsOnSecond(), [[tok("1").input_ids]] * 2, max_turns=4)
    rollout = e.generate([tok("p").input_ids], 1, seed=0)
    assert len(e.engine.calls) == 2  # no third turn once done
    # "bye\n", the answer that ends it, is kept in the turn records only: no turn reads it
    assert rollout.completion_ids[0].tolist() == tok("go\n1ok\n1").input_ids
    assert rollout.fields["turns"][0][-1]["observation"] == "bye\n" and rollout.fields["env_return"] == [3.0]
    torch.testing.assert_close(
        rollout.turn_rewards, torch.tensor([[1.0, 2.0, float("nan"), float("nan")]]), equal_nan=True
    )
    assert rollout.fields["env_done"] == [True] and not rollout.truncated.any()


def test_every_episodes_copy_of_the_environment_is_closed_and_a_failed_close_is_only_logged(caplog):
    tok = char_tokenizer()

    class Closes(Echo):
        closed: ClassVar[list] = []

        def close(self):
            Closes.closed.append(self.turn)
            if len(Closes.closed) > 1:
                raise OSError("already gone")

    e = scripted(Closes(), [[tok("1").input_ids] * 3] * 2, max_turns=2)
    rollout = e.generate([tok("p").input_ids], 3, seed=0)
    assert Closes.closed == [2, 2, 2]  # each of the three copies, after its two turns
    assert rollout.fields["env_return"] == [0.5] * 3  # rewards 0 + 0.5: the rollout is kept
    assert "2 of 3 episodes failed to close; the first: already gone" in caplog.text


def test_when_an_episode_fails_to_open_the_opened_ones_are_closed_and_the_error_raised(caplog):
    tok = char_tokenizer()

    class RefusesBad(Echo):
        closed: ClassVar[list] = []

        def reset(self, seed, task):
            if task == "bad":
                raise ValueError("no such task")
            return super().reset(seed, task)

        def close(self):
            RefusesBad.closed.append(self.turn)

    e = scripted(RefusesBad(), [], max_turns=1)
    with pytest.raises(ValueError, match="no such task"):
        e.generate([tok("p").input_ids, tok("q").input_ids], 2, seed=0, tasks=["ok", "bad"])
    assert RefusesBad.closed == [0, 0]  # the two episodes of "ok", never stepped; none of "bad" (never opened)
    assert "failed to close" not in caplog.text


def test_episode_seeds_are_reproducible_and_fit_a_32_bit_integer():
    seeds = episode_seeds(7, 256)
    assert seeds == episode_seeds(7, 256) and len(set(seeds)) == 256
    assert all(0 <= s < 2**31 for s in seeds)  # with seeds up to 2**32, about half would not fit
