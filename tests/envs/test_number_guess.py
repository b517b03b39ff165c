import random

import pytest

from gpo.envs import NumberGuess, Step


def test_higher_lower_correct_invalid():
    env = NumberGuess(low=1, high=8)
    assert env.reset(seed=3, task="guess 1-8:") == ""
    secret = random.Random(3).randint(1, 8)  # the secret is the seed's first draw
    assert env.secret == secret
    assert env.step("no number") == Step("invalid\n", 0.0, False, {"guess": None})
    assert env.step("9" * 5000) == Step("invalid\n", 0.0, False, {"guess": None})  # beyond int()'s digit limit
    assert env.step(f"{secret - 1}") == Step("higher\n", 0.0, False, {"guess": secret - 1})
    assert env.step(f"x{secret + 1}y") == Step("lower\n", 0.0, False, {"guess": secret + 1})
    observation, reward, done, info = env.step(f" {secret}")
    assert (observation, reward, done, info) == ("correct\n", 1.0, True, {"guess": secret})


def test_same_seed_same_secret_and_bad_settings():
    assert NumberGuess().reset(7, "") == NumberGuess().reset(7, "")
    first, second = NumberGuess(), NumberGuess()
    first.reset(7, "a"), second.reset(7, "b")
    assert first.secret == second.secret
    with pytest.raises(ValueError, match="low=5 must be <= high=2"):
        NumberGuess(low=5, high=2)
    with pytest.raises(RuntimeError, match="before reset"):
        NumberGuess().step("1")


def test_a_one_number_range_a_negative_secret_and_the_win_reward():
    single = NumberGuess(low=3, high=3)
    single.reset(seed=0, task="")
    assert single.step("3") == Step("correct\n", 1.0, True, {"guess": 3})
    env = NumberGuess(low=-8, high=-1, win_reward=2.5)
    env.reset(seed=3, task="")
    secret = random.Random(3).randint(-8, -1)
    assert env.step(f"{secret}") == Step("correct\n", 2.5, True, {"guess": secret})  # "-5" is -5, not 5
