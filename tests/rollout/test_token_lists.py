import pytest
import torch

from gpo.rollout import Sampling
from gpo.rollout.token_lists import greedy_copies, prompt_seeds, rollout_from_token_lists, vllm_request


def test_rollout_from_token_lists_hand_worked():
    # 2 prompts x n=2; EOS = 1, pad = 0. Row 0 ends with EOS, row 1 is truncated (no EOS), row 2 is EOS alone,
    # row 3 is the longest (3 tokens, truncated).
    rollout = rollout_from_token_lists(
        [[5, 6], [7]],
        2,
        [[4, 1], [4, 5], [1], [8, 9, 10]],
        [[-0.5, -0.25], [-1.0, -2.0], [-0.125], [-1.0, -1.5, -2.5]],
        eos_id=1,
        pad_id=0,
    )
    assert rollout.prompt_ids.tolist() == [[5, 6], [5, 6], [0, 7], [0, 7]]
    assert rollout.prompt_mask.tolist() == [[1, 1], [1, 1], [0, 1], [0, 1]]
    assert rollout.completion_ids.tolist() == [[4, 1, 0], [4, 5, 0], [1, 0, 0], [8, 9, 10]]
    assert rollout.completion_mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert rollout.truncated.tolist() == [False, True, False, True]
    assert rollout.group.tolist() == [0, 0, 1, 1]
    assert rollout.logp.dtype == torch.float32
    assert rollout.logp.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, 0.0], [-0.125, 0.0, 0.0], [-1.0, -1.5, -2.5]]


def test_without_logprobs_logp_is_none():
    rollout = rollout_from_token_lists([[5]], 1, [[1]], None, eos_id=1, pad_id=0)
    assert rollout.logp is None and rollout.truncated.tolist() == [False]


def test_prompt_seeds_are_reproducible_distinct_and_optional():
    assert prompt_seeds(3, 4) == prompt_seeds(3, 4)
    assert len(set(prompt_seeds(3, 4))) == 4
    assert prompt_seeds(3, 4) != prompt_seeds(4, 4)
    assert prompt_seeds(None, 2) == [None, None]


def test_empty_completions_get_one_padded_column_and_count_as_truncated():
    """A completion with no token at all has no EOS: it is truncated, and the tensors keep one (masked) column."""
    rollout = rollout_from_token_lists([[5]], 2, [[], []], [[], []], eos_id=1, pad_id=0)
    assert rollout.completion_ids.tolist() == [[0], [0]]
    assert rollout.completion_mask.tolist() == [[0], [0]]
    assert rollout.logp.tolist() == [[0.0], [0.0]]
    assert rollout.truncated.tolist() == [True, True]


@pytest.mark.parametrize("count", [3, 5])
def test_a_completion_count_other_than_prompts_times_n_is_refused(count):
    with pytest.raises(ValueError, match=rf"^{count} completions for 2 prompts x n=2\.$"):
        rollout_from_token_lists([[5], [6]], 2, [[1]] * count, None, eos_id=1, pad_id=0)


def test_a_vllm_request_carries_the_sampling_settings_and_stops_at_the_tokenizers_eos_alone():
    sampling = Sampling(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12)
    assert vllm_request(sampling, 4, greedy=False, seed=11, logprobs=True, eos_id=2) == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 12,
        "ignore_eos": True,  # the checkpoint's other EOS ids do not stop it ...
        "stop_token_ids": [2],  # ... the tokenizer's does
        "logprobs": 0,  # the sampled token's log-prob only
        "seed": 11,
    }
    assert vllm_request(sampling, 4, greedy=False, seed=None, logprobs=False, eos_id=2)["logprobs"] is None


def test_a_greedy_vllm_request_asks_for_one_sample_at_temperature_0_that_stands_for_all_n():
    """vLLM refuses ``n > 1`` with greedy decoding: one sample is asked for, and the caller repeats it n times."""
    request = vllm_request(Sampling(temperature=0.7), 4, greedy=True, seed=11, logprobs=True, eos_id=2)
    assert (request["n"], request["temperature"]) == (1, 0.0)
    assert greedy_copies(4, greedy=True) == 4 and greedy_copies(4, greedy=False) == 1
