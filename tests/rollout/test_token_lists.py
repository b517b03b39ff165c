import torch

from gpo.rollout.token_lists import prompt_seeds, rollout_from_token_lists


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
