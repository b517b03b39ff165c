import copy
import logging.handlers
import math
import re

import pytest
import torch

from gpo.algo import WeightedSum
from gpo.models.scorer import position_ids, score_tokens
from gpo.rollout import HFEngine, Sampling
from gpo.rollout.hf import completion_mask, grouped_prompts
from gpo.testing import char_tokenizer, tiny_model


@pytest.fixture(scope="module")
def policy_and_tokenizer():
    return tiny_model("llama", seed=0), char_tokenizer()


def engine(policy_and_tokenizer, batch_size=None, **sampling):
    e = HFEngine(sampling=Sampling(**sampling), batch_size=batch_size)
    e.setup(*policy_and_tokenizer)
    return e


def naive_logprobs(model, input_ids, attention_mask, length, temperature):
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)).logits
    logp = torch.log_softmax(logits[:, -length - 1 : -1].double() / temperature, -1)
    return logp.gather(-1, input_ids[:, -length:, None])[..., 0]


def test_grouped_prompts_and_completion_mask_hand_worked():
    ids, mask, group = grouped_prompts([[5, 6], [7]], 2, pad_id=0)
    assert ids.tolist() == [[5, 6], [5, 6], [0, 7], [0, 7]] and mask.tolist() == [[1, 1], [1, 1], [0, 1], [0, 1]]
    assert group.tolist() == [0, 0, 1, 1]
    ids, mask, group = grouped_prompts([[3], [8, 9, 4], [2, 2]], 1, pad_id=1)
    assert ids.tolist() == [[1, 1, 3], [8, 9, 4], [1, 2, 2]] and group.tolist() == [0, 1, 2]
    # EOS = 1: row 0 ends at position 1 (EOS kept in the mask), row 1 has no EOS (truncated), row 2 EOS first, row 3
    # a second EOS after the first, row 4 EOS last
    completions = [[4, 1, 0, 0], [4, 5, 6, 7], [1, 0, 0, 0], [3, 1, 1, 1], [3, 3, 3, 1]]
    mask, truncated = completion_mask(torch.tensor(completions), eos_id=1)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert truncated.tolist() == [False, True, False, False, False]


def test_generates_n_grouped_samples_with_masks_and_logprobs(policy_and_tokenizer):
    model, tok = policy_and_tokenizer
    prompts = [tok("sort 312:").input_ids, tok("ab").input_ids]
    rollout = engine(policy_and_tokenizer, temperature=0.9, max_new_tokens=6).generate(prompts, n=3, seed=0)
    assert len(rollout) == 6 and rollout.group.tolist() == [0, 0, 0, 1, 1, 1]
    assert rollout.completion_ids.shape[1] <= 6
    # prompts are left-padded copies of the inputs
    for row, prompt in enumerate([prompts[0]] * 3 + [prompts[1]] * 3):
        assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == prompt
    # padding after EOS carries no mask and no log-prob; truncated rows have no EOS
    eos = tok.eos_token_id
    for row in range(6):
        tokens = rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()
        assert (eos not in tokens) == rollout.truncated[row].item()
        assert eos not in tokens[:-1]
    assert torch.all(rollout.logp[rollout.completion_mask == 0] == 0)
    ref = naive_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_ids.shape[1], 0.9)
    real = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.logp[real].double(), ref[real], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def naive_greedy(model, prompt: list[int], budget: int, eos: int) -> list[int]:
    """Argmax of the policy's own logits, one full forward pass per token, up to EOS or ``budget`` tokens."""
    ids = list(prompt)
    while len(ids) - len(prompt) < budget and (len(ids) == len(prompt) or ids[-1] != eos):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_the_checkpoints_own_generation_settings_do_not_reach_the_samples(policy_and_tokenizer):
    """A checkpoint's generation config may set a repetition penalty (Qwen2.5's instruct models do), banned n-grams,
    a minimum length, more rows per prompt, a maximum length; ``generate`` applies whatever its config leaves unset
    from there. The engine samples the policy itself: the same samples as without those settings, with no warning,
    and greedy completions that are the argmax of the policy's logits."""
    model, tok = policy_and_tokenizer
    prompts = [tok(text).input_ids for text in ("sort 312:", "ab")]
    plain = engine(policy_and_tokenizer, max_new_tokens=12)
    settings = {"repetition_penalty": 3.0, "no_repeat_ngram_size": 2, "min_length": 40, "typical_p": 0.5,
                "num_return_sequences": 2, "do_sample": True, "return_dict_in_generate": True, "min_p": 0.0,
                "max_length": 4096, "min_new_tokens": 0}  # fmt: skip
    checkpoint = copy.deepcopy(model)
    checkpoint.generation_config.update(**settings)
    own = engine((checkpoint, tok), max_new_tokens=12)
    notices = logging.handlers.BufferingHandler(100)  # transformers' own warnings during sampling
    logging.getLogger("transformers.generation.utils").addHandler(notices)
    try:
        sampled = own.generate(prompts, n=4, seed=0)
    finally:
        logging.getLogger("transformers.generation.utils").removeHandler(notices)
    assert not [record.getMessage() for record in notices.buffer]  # max_length 4096: max_new_tokens wins, unsaid
    assert torch.equal(sampled.completion_ids, plain.generate(prompts, n=4, seed=0).completion_ids)
    assert not bool(sampled.truncated.all())  # min_length would have forbidden EOS
    for prompt in prompts:
        greedy = own.generate([prompt], n=1, greedy=True)
        tokens = greedy.completion_ids[0][greedy.completion_mask[0].bool()].tolist()
        assert tokens == naive_greedy(model, prompt, 12, tok.eos_token_id)


def test_a_checkpoint_saved_without_its_kv_cache_still_samples_with_one(policy_and_tokenizer):
    """A checkpoint saved from a run with gradient checkpointing often has ``use_cache: false``; sampling from it
    still feeds the model one new token per step after the prompt, and samples what the cached model samples."""
    model, tok = policy_and_tokenizer
    checkpoint = copy.deepcopy(model)
    checkpoint.config.use_cache = checkpoint.generation_config.use_cache = False
    widths = []
    checkpoint.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                         with_kwargs=True)  # fmt: skip
    prompts = [tok("sort 312:").input_ids]
    sampled = engine((checkpoint, tok), max_new_tokens=6).generate(prompts, n=2, seed=0, logprobs=False)
    assert widths[0] == len(prompts[0]) and set(widths[1:]) == {1} and len(widths) > 1
    plain = engine(policy_and_tokenizer, max_new_tokens=6).generate(prompts, n=2, seed=0, logprobs=False)
    assert torch.equal(sampled.completion_ids, plain.completion_ids)


@pytest.mark.parametrize(
    "setting",
    [{"min_p": 0.1}, {"forced_eos_token_id": 5}, {"suppress_tokens": [5, 6]}, {"min_new_tokens": 3}, {"max_time": 5.0}],
)
def test_a_checkpoint_setting_that_cannot_be_neutralised_is_refused_at_setup(policy_and_tokenizer, setting):
    """Settings whose off value is None, which ``generate`` would fill from the checkpoint: the error names them."""
    model, tok = policy_and_tokenizer
    checkpoint = copy.deepcopy(model)
    checkpoint.generation_config.update(**setting)
    name, value = next(iter(setting.items()))
    with pytest.raises(ValueError, match=rf"sets {re.escape(f'{name}={value!r}')}.*generation_config.json"):
        HFEngine().setup(checkpoint, tok)


def test_seed_makes_sampling_reproducible_and_greedy_is_deterministic(policy_and_tokenizer):
    _, tok = policy_and_tokenizer
    e = engine(policy_and_tokenizer, max_new_tokens=8)
    prompts = [tok("hello").input_ids]
    a, b = e.generate(prompts, n=4, seed=7), e.generate(prompts, n=4, seed=7)
    assert torch.equal(a.completion_ids, b.completion_ids)
    greedy = e.generate(prompts, n=3, greedy=True)
    assert all(torch.equal(greedy.completion_ids[0], row) for row in greedy.completion_ids)


def test_a_seeded_call_leaves_the_global_generator_as_it_was(policy_and_tokenizer):
    """The seed is the call's own: the trainer's draws from torch's generator (minibatch shuffles, dropout) go on from
    where they were, not from the rollout seed."""
    _, tok = policy_and_tokenizer
    e = engine(policy_and_tokenizer, max_new_tokens=4)
    torch.manual_seed(11)
    state = torch.random.get_rng_state()
    e.generate([tok("ab").input_ids], n=2, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_batched_generation_matches_one_call_under_greedy(policy_and_tokenizer):
    _, tok = policy_and_tokenizer
    prompts = [tok(text).input_ids for text in ("a", "bcd", "efghij")]
    whole = engine(policy_and_tokenizer, max_new_tokens=5).generate(prompts, n=2, greedy=True)
    split = engine(policy_and_tokenizer, max_new_tokens=5, batch_size=2).generate(prompts, n=2, greedy=True)
    width = min(whole.completion_ids.shape[1], split.completion_ids.shape[1])
    assert torch.equal(whole.completion_ids[:, :width], split.completion_ids[:, :width])


def test_every_row_truncated_when_budget_is_one_token(policy_and_tokenizer):
    _, tok = policy_and_tokenizer
    rollout = engine(policy_and_tokenizer, max_new_tokens=1).generate([tok("xy").input_ids], n=4, seed=1)
    assert rollout.completion_ids.shape == (4, 1)
    eos_rows = rollout.completion_ids[:, 0] == tok.eos_token_id
    assert torch.equal(rollout.truncated, ~eos_rows)


def test_select_keeps_rows_consistent(policy_and_tokenizer):
    _, tok = policy_and_tokenizer
    rollout = engine(policy_and_tokenizer, max_new_tokens=3).generate([tok("a").input_ids, tok("b").input_ids], n=2)
    rollout.fields = {"answer": ["x", "x", "y", "y"]}
    part = rollout.select([3, 0])
    assert part.group.tolist() == [1, 0] and part.fields["answer"] == ["y", "x"]
    assert torch.equal(part.completion_ids[0], rollout.completion_ids[3])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe"])
def test_score_tokens_fused_path_matches_model_logits(arch):
    model = tiny_model(arch, seed=1)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    out = score_tokens(model, ids, mask, 3, temperature=0.7, router=arch == "qwen2_moe")
    torch.testing.assert_close(out.logp.double(), naive_logprobs(model, ids, mask, 3, 0.7), atol=1e-5, rtol=1e-5)
    assert (out.router_logp is not None) == (arch == "qwen2_moe")


def test_sampling_settings_are_validated():
    with pytest.raises(ValueError, match="temperature=0"):
        Sampling(temperature=0)
    with pytest.raises(ValueError, match=r"top_p=1\.5"):
        HFEngine(sampling=Sampling(top_p=1.5))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        HFEngine(sampling=Sampling(max_new_tokens=0))


def test_logprobs_are_skipped_when_not_asked_for(policy_and_tokenizer):
    _, tok = policy_and_tokenizer
    e = engine(policy_and_tokenizer, max_new_tokens=3)
    assert e.generate([tok("ab").input_ids], n=2, seed=0, logprobs=False).logp is None
    assert e.generate([tok("ab").input_ids], n=2, seed=0).logp is not None


def test_concat_rollouts_repads_and_keeps_groups_apart(policy_and_tokenizer):
    from gpo.rollout.base import concat_rollouts

    _, tok = policy_and_tokenizer
    e = engine(policy_and_tokenizer, max_new_tokens=4)
    a = e.generate([tok("a").input_ids], n=2, seed=0)
    b = e.generate([tok("bcdef").input_ids, tok("g").input_ids], n=2, seed=1, logprobs=False)
    a.fields, b.fields = {"answer": ["x"] * 2}, {"answer": ["y"] * 4}
    both = concat_rollouts([a, b])
    assert len(both) == 6 and both.num_groups == 3 and both.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert both.logp is None  # one part had none
    assert both.fields["answer"] == ["x", "x", "y", "y", "y", "y"]
    for part, rows in ((a, range(2)), (b, range(2, 6))):
        for i, row in enumerate(rows):
            assert both.prompt_ids[row][both.prompt_mask[row].bool()].tolist() == (
                part.prompt_ids[i][part.prompt_mask[i].bool()].tolist()
            )
            assert both.completion_ids[row][both.completion_mask[row].bool()].tolist() == (
                part.completion_ids[i][part.completion_mask[i].bool()].tolist()
            )
    b.fields = {}  # e.g. a draw_rollout that forgot the dataset's columns
    with pytest.raises(ValueError, match=r"the first has \['answer'\], part 1 has \[\] \(a rollout drawn by "):
        concat_rollouts([a, b])


@pytest.mark.parametrize("batch_size", [None, 2])
def test_sampling_in_inference_mode_hands_back_tensors_a_gradient_pass_may_save(policy_and_tokenizer, batch_size):
    model, tok = policy_and_tokenizer
    prompts = [tok("sort 312:").input_ids, tok("ab").input_ids]
    rollout = engine(policy_and_tokenizer, batch_size=batch_size, max_new_tokens=4).generate(prompts, n=2, seed=0)
    tensors = {name: value for name, value in vars(rollout).items() if isinstance(value, torch.Tensor)}
    assert {"completion_ids", "completion_mask", "truncated", "logp"} <= set(tensors)
    assert not [name for name, value in tensors.items() if value.is_inference()]
    embedded = model.get_input_embeddings()(rollout.completion_ids)  # saves the token ids for its backward
    (embedded * rollout.completion_mask[..., None]).sum().backward()  # raises if they are inference tensors
    assert model.get_input_embeddings().weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_the_collector_gives_every_completion_its_prompt_its_fields_and_its_text(policy_and_tokenizer):
    """Rows of a group are adjacent: the rows of prompt ``p`` get ``p``'s text and dataset fields, and each row's
    completion text is its own tokens up to EOS, without the EOS or the padding after it."""
    from gpo.rollout.collector import Collector

    model, tok = policy_and_tokenizer
    collector = Collector(HFEngine(sampling=Sampling(max_new_tokens=8)), [], group_size=4)
    collector.setup(model, tok)
    batch = {"prompt": ["ab", "cde"], "prompt_ids": [tok("ab").input_ids, tok("cde").input_ids],
             "fields": {"answer": ["x", "y"]}}  # fmt: skip
    rollout = collector.sample(batch, seed=0)
    assert rollout.prompts == ["ab"] * 4 + ["cde"] * 4 and rollout.fields["answer"] == ["x"] * 4 + ["y"] * 4
    assert not rollout.truncated.all()  # some row ends with EOS (and padding after it), which the text leaves out
    for row, text in enumerate(rollout.completions):
        tokens = rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()
        assert text == tok.decode([t for t in tokens if t != tok.eos_token_id]), row


class Mixed(WeightedSum):
    """The weighted sum, with ``how`` applied to it."""

    def __init__(self, how) -> None:
        super().__init__()
        self.how = how

    def __call__(self, scores, group):
        return self.how(super().__call__(scores, group))


@pytest.mark.parametrize(
    ("how", "said"),
    [
        (lambda reward: reward * torch.nan, "returned a reward that is not finite (nan or inf) for 8 of 8 completions"),
        (
            lambda reward: torch.where(reward > -1, math.inf, 0.0),
            "returned a reward that is not finite (nan or inf) for 8 of 8",
        ),
        (lambda reward: reward[:4], "returned [4]; RewardMixer.__call__ returns one reward per completion, [B] = [8]"),
        (lambda reward: reward.tolist(), "returned list; RewardMixer.__call__ returns one reward per completion"),
    ],
    ids=["nan", "inf", "too few", "list"],
)
def test_a_mixer_whose_reward_is_not_one_finite_value_per_completion_is_named(policy_and_tokenizer, how, said):
    """A NaN reward would vanish into zero advantages (a NaN group std divides nothing) and the run would look fine."""
    from gpo.rollout.collector import Collector

    model, tok = policy_and_tokenizer
    collector = Collector(HFEngine(sampling=Sampling(max_new_tokens=4)), [lambda prompts, completions, **_: [1.0] * 8],
                          mixer=Mixed(how), group_size=4)  # fmt: skip
    collector.setup(model, tok)
    batch = {"prompt": ["ab", "cde"], "prompt_ids": [tok("ab").input_ids, tok("cde").input_ids], "fields": {}}
    with pytest.raises(ValueError, match=re.escape(f"the reward mixer Mixed {said}")):
        collector.collect(batch)


def test_logprobs_are_at_the_temperature_the_call_samples_at(policy_and_tokenizer):
    """A call whose ``sampling`` replaces the engine's temperature gets the sampled tokens' log-probs at its own."""
    model, tok = policy_and_tokenizer
    e = engine(policy_and_tokenizer, temperature=1.0, max_new_tokens=4)
    rollout = e.generate([tok("ab").input_ids], n=2, seed=0, sampling=Sampling(temperature=0.5, max_new_tokens=4))
    ref = naive_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_ids.shape[1], 0.5)
    real = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.logp[real].double(), ref[real], atol=1e-5, rtol=1e-5)


def test_concat_rollouts_pads_multi_turn_fields_as_past_the_episode():
    """Joined multi-turn rollouts of different widths: ``turn_index`` -1 and ``loss_mask`` 0 on the padding,
    ``turn_rewards`` NaN past each episode's turns."""
    from gpo.rollout.base import Rollout, concat_rollouts

    def episode(width: int, turns: int) -> Rollout:
        """One row of ``width`` completion tokens, the first the policy's (turn 0), the others the environment's; and
        ``turns`` step rewards."""
        ids, first = torch.ones(1, width, dtype=torch.long), torch.zeros(1, width, dtype=torch.long)
        first[0, 0] = 1
        rewards = torch.arange(1.0, turns + 1)[None]  # [1, turns]
        return Rollout(ids, ids, ids, ids, torch.zeros(1, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                       loss_mask=first, turn_rewards=rewards, turn_index=first - 1)  # fmt: skip

    both = concat_rollouts([episode(3, 2), episode(1, 1)])
    assert both.turn_index.tolist() == [[0, -1, -1], [0, -1, -1]]
    assert both.loss_mask.tolist() == [[1, 0, 0], [1, 0, 0]]
    assert both.turn_rewards[0].tolist() == [1.0, 2.0] and both.turn_rewards[1, 0] == 1
    assert both.turn_rewards[1, 1].isnan()


@pytest.mark.parametrize("sampling", [{"max_new_tokens": 4}, 4])
def test_sampling_that_is_not_a_sampling_is_refused_when_the_engine_is_built(sampling):
    """A dict of its fields (the YAML form) would otherwise pass until the first rollout, as an AttributeError."""
    with pytest.raises(TypeError, match=r"HFEngine\(sampling=.*\) takes gpo.rollout.Sampling\(temperature=\.\.\."):
        HFEngine(sampling=sampling)


@pytest.mark.parametrize(("sampling", "shown"), [({"max_new_tokens": 4}, "{'max_new_tokens': 4}"), (4, "int")])
def test_a_refused_sampling_is_shown_as_written_when_a_mapping_and_by_its_type_otherwise(sampling, shown):
    with pytest.raises(TypeError, match=rf"^HFEngine\(sampling={re.escape(shown)}\) takes "):
        HFEngine(sampling=sampling)
