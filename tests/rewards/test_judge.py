import time

import pytest
import torch
from aiohttp import web

from gpo.algo import EnvEventOutcomeBlend
from gpo.rewards import JudgeError, JudgeReward, env_reward
from gpo.rewards.judge_app import make_app
from tests.envs.servers import Faults, post_json, serve, with_faults

FAST = {"timeout_s": 5.0, "attempts": 3, "backoff_s": 0.01}
# Three episodes as MultiTurnEngine records them: (action, reward) per turn.
EPISODES = [[("x", 0.0), ("4", 0.0), ("6", 1.0)], [("5", 0.0), ("zz", 0.0)], [("3", 1.0)]]
TURNS = [[{"action": a, "observation": "", "reward": r, "info": {}} for a, r in episode] for episode in EPISODES]
PROMPTS, COMPLETIONS = ["guess 1-8:"] * 3, ["", "", ""]


@pytest.fixture
def judge_url():
    with serve(make_app()) as url:
        yield url


def test_event_and_outcome_scores_hand_worked(judge_url):
    event = JudgeReward(judge_url=judge_url, kind="event", **FAST)
    outcome = JudgeReward(judge_url=judge_url, kind="outcome", **FAST)
    # events: 1 per action holding an integer, mean over the turns: 2/3, 1/2, 1
    assert event(PROMPTS, COMPLETIONS, turns=TURNS) == pytest.approx([2 / 3, 1 / 2, 1.0])
    # outcome: 1 when the last turn earned a reward
    assert outcome(PROMPTS, COMPLETIONS, turns=TURNS) == [1.0, 0.0, 1.0]
    assert event.name == "judge_event" and outcome.name == "judge_outcome"


def test_an_episode_without_turns_scores_0_and_a_trailing_slash_in_judge_url_is_fine(judge_url):
    turns = [[], *TURNS[:1]]  # an episode that ended before the policy's first turn, then episode 0
    event = JudgeReward(judge_url=judge_url + "/", kind="event", **FAST)
    outcome = JudgeReward(judge_url=judge_url + "/", kind="outcome", **FAST)
    assert event(PROMPTS[:2], COMPLETIONS[:2], turns=turns) == pytest.approx([0.0, 2 / 3])  # no request: 0
    assert outcome(PROMPTS[:2], COMPLETIONS[:2], turns=turns) == [0.0, 1.0]  # the judge scores no turns 0


def test_an_event_shows_the_history_up_to_its_turn_and_an_outcome_all_of_it():
    bodies = []
    routes = web.RouteTableDef()

    @routes.post("/score")
    async def score(request):
        bodies.append(await request.json())
        return web.json_response({"score": float(len(bodies[-1]["turns"]))})

    app = web.Application()
    app.add_routes(routes)
    turns = TURNS[1:2]  # two turns: "5", then "zz"
    with serve(app) as url:
        # event scores: 1 turn shown, then 2: their mean is 1.5; outcome: both turns shown
        assert JudgeReward(judge_url=url, kind="event", **FAST)(PROMPTS[:1], COMPLETIONS[:1], turns=turns) == [1.5]
        assert JudgeReward(judge_url=url, kind="outcome", **FAST)(PROMPTS[:1], COMPLETIONS[:1], turns=turns) == [2.0]
    first, second = TURNS[1]
    assert sorted(bodies[:2], key=lambda body: body["turn"]) == [
        {"kind": "event", "prompt": PROMPTS[0], "completion": "", "turns": [first], "turn": 0},
        {"kind": "event", "prompt": PROMPTS[0], "completion": "", "turns": [first, second], "turn": 1},
    ]
    assert bodies[2] == {"kind": "outcome", "prompt": PROMPTS[0], "completion": "", "turns": [first, second], "turn": 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_concurrency": 0}, "max_concurrency=0 must be >= 1"),
        ({"judge_url": "127.0.0.1:8002"}, "judge_url='127.0.0.1:8002' must be an http:// or https:// URL"),
        ({"health_max_wait_s": 0.0}, "health_max_wait_s=0.0 must be > 0"),
    ],
)
def test_invalid_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        JudgeReward(**{"judge_url": "http://127.0.0.1:1", **kwargs})


def test_env_event_outcome_blend_hand_worked(judge_url):
    env_return = [sum(r for _, r in episode) for episode in EPISODES]  # 1, 0, 1
    columns = [
        env_reward(PROMPTS, COMPLETIONS, env_return=env_return),
        JudgeReward(judge_url=judge_url, kind="event", **FAST)(PROMPTS, COMPLETIONS, turns=TURNS),
        JudgeReward(judge_url=judge_url, kind="outcome", **FAST)(PROMPTS, COMPLETIONS, turns=TURNS),
    ]
    scores = torch.tensor(columns).T  # [B, 3]: env, event, outcome
    reward = EnvEventOutcomeBlend(env=1.0, event=0.5, outcome=2.0)(scores, torch.tensor([0, 0, 0]))
    # row 0: 1 + .5 * 2/3 + 2 * 1 = 10/3; row 1: 0 + .5 * .5 + 0 = .25; row 2: 1 + .5 + 2 = 3.5
    torch.testing.assert_close(reward, torch.tensor([10 / 3, 0.25, 3.5]))


def test_max_concurrency_bounds_requests_in_flight():
    faults = Faults(where="/score", delay_s=0.05)
    with serve(with_faults(make_app(), faults)) as url:
        judge = JudgeReward(judge_url=url, kind="event", max_concurrency=2, **FAST)
        judge(PROMPTS * 2, COMPLETIONS * 2, turns=TURNS * 2)  # 12 events
    assert faults.count("POST", "/score") == 12 and faults.max_in_flight == 2


def test_500s_are_retried_then_a_timeout_is_a_clear_error():
    faults = Faults(where="/score", fail_first=2)
    with serve(with_faults(make_app(), faults)) as url:
        assert JudgeReward(judge_url=url, **FAST)(PROMPTS, COMPLETIONS, turns=TURNS) == [1.0, 0.0, 1.0]
    assert faults.count("POST", "/score") == 3 * 3
    slow = Faults(where="/score", delay_s=2.0)
    with serve(with_faults(make_app(), slow)) as url:
        judge = JudgeReward(judge_url=url, timeout_s=0.2, attempts=2, backoff_s=0.01)
        started = time.perf_counter()
        with pytest.raises(JudgeError, match=rf"judge_url={url} .*failed after 2 attempt\(s\).*timeout_s=0.2"):
            judge(PROMPTS, COMPLETIONS, turns=TURNS)
        assert time.perf_counter() - started < 1.5


def test_without_turns_the_judge_says_which_engine_it_needs():
    with pytest.raises(ValueError, match="MultiTurnEngine"):
        JudgeReward(judge_url="http://127.0.0.1:1")(PROMPTS, COMPLETIONS)
    with pytest.raises(ValueError, match="'event' or 'outcome'"):
        JudgeReward(judge_url="http://127.0.0.1:1", kind="episode")


def test_a_body_the_judge_cannot_use_is_answered_400_never_500(judge_url):
    turn = {"action": "3", "observation": "", "reward": 1.0, "info": {}}
    refused = {
        "a list, not an object": [],
        "no kind": {"turns": [turn]},
        "turns not a list": {"kind": "event", "turns": 5},
        "a turn not an object": {"kind": "event", "turns": ["3"]},
        "an action not a string": {"kind": "event", "turns": [{**turn, "action": 3}]},
        "a reward not a number": {"kind": "outcome", "turns": [{**turn, "reward": "high"}]},
        "a turn index not an integer": {"kind": "event", "turns": [turn], "turn": "0"},
        "a turn index out of range": {"kind": "event", "turns": [turn], "turn": -2},
        "a turn index one past the last turn": {"kind": "event", "turns": [turn], "turn": 1},
        "a turn index that is a boolean": {"kind": "event", "turns": [turn, turn], "turn": True},
    }
    for what, body in refused.items():
        status, answer = post_json(f"{judge_url}/score", body)
        assert status == 400 and answer["error"], what
    for what, raw in {"not JSON": b"{", "nested too deeply": b"[" * 5000 + b"]" * 5000}.items():
        assert post_json(f"{judge_url}/score", raw=raw)[0] == 400, what
    assert post_json(f"{judge_url}/score", {"kind": "event", "turns": [turn], "turn": 0}) == (200, {"score": 1.0})
    guess_then_text = [turn, {**turn, "action": "no guess"}]  # the judged turn is scored, not the last one
    assert post_json(f"{judge_url}/score", {"kind": "event", "turns": guess_then_text, "turn": 0}) == (
        200,
        {"score": 1.0},
    )
    assert post_json(f"{judge_url}/score", {"kind": "outcome", "turns": [], "turn": -1}) == (200, {"score": 0.0})


@pytest.mark.parametrize("answer", [{"score": True}, {"score": "1"}, {"score": float("nan")}, [1.0]])
def test_an_answer_that_is_not_a_number_is_refused_naming_it(answer):
    # JSON true is a bool in Python, and bool is an int: it must not pass for a score of 1
    routes = web.RouteTableDef()

    @routes.post("/score")
    async def score(request):
        return web.json_response(answer)

    app = web.Application()
    app.add_routes(routes)
    with serve(app) as url, pytest.raises(JudgeError, match=r"POST /score answered .*expected \{'score': number\}"):
        JudgeReward(judge_url=url, **FAST)(PROMPTS[:1], COMPLETIONS[:1], turns=TURNS[:1])


def test_a_body_above_max_body_bytes_is_refused_with_413_and_not_retried():
    faults = Faults(where="/score")
    with serve(with_faults(make_app(max_body_bytes=2000), faults)) as url:
        long = [[{"action": "x" * 3000, "observation": "", "reward": 0.0, "info": {}}]]
        with pytest.raises(JudgeError, match=r"refused with HTTP 413 \(not retried.*raise its --max-body-bytes"):
            JudgeReward(judge_url=url, **FAST)(PROMPTS[:1], COMPLETIONS[:1], turns=long)
    assert faults.count("POST", "/score") == 1


def test_with_a_token_the_judge_refuses_requests_without_it_and_the_reward_sends_it(monkeypatch):
    monkeypatch.delenv("GPO_JUDGE_TOKEN", raising=False)
    faults = Faults(where="/score")
    with serve(with_faults(make_app(token="s3cret"), faults)) as url:
        with pytest.raises(JudgeError, match=r"HTTP 401 \(not retried.*GPO_JUDGE_TOKEN"):
            JudgeReward(judge_url=url, **FAST)(PROMPTS, COMPLETIONS, turns=TURNS)
        assert set(faults.seen.values()) == {1}  # each request sent once: a refusal is not retried
        assert JudgeReward(judge_url=url, token="s3cret", **FAST)(PROMPTS, COMPLETIONS, turns=TURNS) == [1.0, 0.0, 1.0]
        monkeypatch.setenv("GPO_JUDGE_TOKEN", "s3cret")
        assert JudgeReward(judge_url=url, **FAST)(PROMPTS, COMPLETIONS, turns=TURNS) == [1.0, 0.0, 1.0]


def test_a_judge_that_is_down_fails_the_set_up_before_any_rollout_naming_it():
    from aiohttp import web

    from gpo.rollout import HFEngine, Sampling
    from gpo.rollout.collector import Collector
    from gpo.testing import char_tokenizer, tiny_model
    from tests.ports import free_port

    down = f"http://127.0.0.1:{free_port()}"
    collector = Collector(HFEngine(sampling=Sampling(max_new_tokens=2)), [env_reward, JudgeReward(
        judge_url=down, health_max_wait_s=0.5, **FAST)], group_size=2)  # fmt: skip
    with pytest.raises(JudgeError, match=rf"judge at judge_url={down} .* did not answer 200 within health_max_wait_s"):
        collector.setup(tiny_model(), char_tokenizer())
    with serve(web.Application()) as url:
        JudgeReward(judge_url=url, **FAST).wait_ready()  # a judge without GET /health (404) is up: it answered

    async def post_health(request):
        return web.json_response({})

    post_only = web.Application()
    post_only.router.add_post("/health", post_health)
    with serve(post_only) as url:
        JudgeReward(judge_url=url, **FAST).wait_ready()  # GET /health not allowed (405): up as well
    with serve(make_app()) as url:
        Collector(HFEngine(), [JudgeReward(judge_url=url, **FAST)], group_size=2).setup(tiny_model(), char_tokenizer())
