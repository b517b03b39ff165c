"""Judges over HTTP as reward functions: ``event`` scores each policy turn, ``outcome`` each whole episode.

Protocol (the reference server is ``gpo.rewards.judge_app``): ``GET /health`` answers 200 once the judge is ready
(checked before the first rollout; a judge without the route, answering 404 or 405, counts as ready once it
answers); ``POST /score`` with ``{"kind": "event" | "outcome",
"prompt": STR, "completion": STR, "turns": [{"action", "observation", "reward", "info"}, ...], "turn": INT}``
answers ``{"score": FLOAT}``. For an event, ``turns`` is the history up to and including the judged turn ``turn``;
for an outcome, every turn (and ``turn`` is the last).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

import aiohttp

from gpo.envs.http import (
    Outages,
    Retries,
    ServiceError,
    bearer,
    protocol_problem,
    request_json,
    token_from,
    wait_healthy,
)
from gpo.rewards.runner import ServedReward

JudgeKind = Literal["event", "outcome"]
#: What a judge's answer to ``POST /score`` holds (``protocol_problem``: a JSON ``true`` is no score).
SCORED = {"score": ((int, float), "a finite number")}
TOKEN_ENV = "GPO_JUDGE_TOKEN"  # the shared secret, read by JudgeReward and by the reference judge (judge_app)
HINTS = {
    401: f"Give the judge's token as JudgeReward's token or the environment variable {TOKEN_ENV}.",
    404: "A judge answers POST /score: check judge_url (host, port and any path prefix).",
    413: "The judge refused a body this large (long episodes): raise its --max-body-bytes.",
}


class JudgeError(ServiceError):
    """The judge at ``judge_url`` is down, too slow, or answered out of protocol."""


class JudgeReward(ServedReward):
    """A reward function ``(prompts, completions, turns, **columns) -> list[float]`` whose scores come from a judge.

    ``outcome``: one request per episode, its score is the reward. ``event``: one request per policy turn, the
    reward is the mean score of the episode's turns (0 for an episode without turns). At most ``max_concurrency``
    requests are in flight; each has its own timeout, and connection errors, timeouts and HTTP 408/429/5xx are
    retried with exponential backoff; any other 4xx is not (the judge refused the request: the error says why).
    ``turns`` is the column ``MultiTurnEngine`` fills. Blend judges with the environment's reward through
    ``EnvEventOutcomeBlend``. Before the first rollout the run waits for ``GET /health`` to answer 200, for at most
    ``health_max_wait_s`` (``wait_ready``).

    Args:
        judge_url: base URL of the judge, e.g. ``http://127.0.0.1:8002``.
        kind: ``event`` or ``outcome``.
        token: shared secret sent as ``Authorization: Bearer TOKEN`` (the judge's ``--token``); None: the environment
            variable ``GPO_JUDGE_TOKEN`` if set, else none. The variable keeps it out of YAML files.
        timeout_s: seconds one request may take.
        max_concurrency: requests in flight at once.
        attempts: tries per request (1: no retry); None: as many as ``retry_max_s`` allows.
        backoff_s: wait before the first retry, doubled for each further one.
        retry_max_s: longest time a failing request is retried, from its first failure; None: ``attempts`` alone
            bounds it.
        health_max_wait_s: longest wait for ``GET /health`` to answer 200 when the run is set up.
    """

    def __init__(
        self,
        *,
        judge_url: str,
        kind: JudgeKind = "outcome",
        token: str | None = None,
        timeout_s: float = 30.0,
        max_concurrency: int = 8,
        attempts: int | None = 3,
        backoff_s: float = 0.5,
        retry_max_s: float | None = None,
        health_max_wait_s: float = 30.0,
    ) -> None:
        if kind not in ("event", "outcome"):
            raise ValueError(f"JudgeReward kind={kind!r} is not valid; choose 'event' or 'outcome'.")
        if max_concurrency < 1:
            raise ValueError(f"JudgeReward max_concurrency={max_concurrency} must be >= 1.")
        if not judge_url.startswith(("http://", "https://")):
            raise ValueError(f"judge_url={judge_url!r} must be an http:// or https:// URL, e.g. http://127.0.0.1:8002.")
        if not health_max_wait_s > 0:
            raise ValueError(f"JudgeReward health_max_wait_s={health_max_wait_s} must be > 0 (seconds).")
        self.judge_url, self.kind, self.max_concurrency = judge_url.rstrip("/"), kind, max_concurrency
        self.token = token_from(token, TOKEN_ENV)
        self.retries = Retries(timeout_s=timeout_s, attempts=attempts, backoff_s=backoff_s, retry_max_s=retry_max_s)
        self.health_max_wait_s = health_max_wait_s
        self.outages = Outages()
        self.name = f"judge_{kind}"

    def wait_ready(self) -> None:
        async def poll() -> None:
            async with aiohttp.ClientSession(headers=bearer(self.token)) as session:
                await wait_healthy(session, f"{self.judge_url}/health", max_wait_s=self.health_max_wait_s,
                                   timeout_s=self.retries.timeout_s, describe=self._describe, hints=HINTS,
                                   up_status=frozenset({404, 405}))  # fmt: skip

        try:
            asyncio.run(poll())
        except ServiceError as exc:
            raise JudgeError(str(exc)) from exc

    @property
    def _describe(self) -> str:
        return (
            f"judge at judge_url={self.judge_url} (is it running and reachable? the reference: "
            "python -m gpo.rewards.judge_app)"
        )

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], turns: Sequence[list] | None = None, **columns
    ) -> list[float]:
        if turns is None:
            raise ValueError(
                f"reward {self.name} needs the 'turns' column of multi-turn rollouts; set model.engine to a "
                "gpo.rollout.MultiTurnEngine."
            )
        requests, owners = [], []
        for row, (prompt, completion, history) in enumerate(zip(prompts, completions, turns, strict=True)):
            judged = range(len(history)) if self.kind == "event" else [len(history) - 1]
            for turn in judged:
                shown = history[: turn + 1] if self.kind == "event" else history
                requests.append(
                    {"kind": self.kind, "prompt": prompt, "completion": completion, "turns": shown, "turn": turn}
                )
                owners.append(row)
        scores = asyncio.run(self._score_all(requests))
        totals, counts = [0.0] * len(prompts), [0] * len(prompts)
        for row, value in zip(owners, scores, strict=True):
            totals[row] += value
            counts[row] += 1
        return [total / count if count else 0.0 for total, count in zip(totals, counts, strict=True)]

    async def _score_all(self, requests: list[dict[str, Any]]) -> list[float]:
        limit = asyncio.Semaphore(self.max_concurrency)
        describe = self._describe
        async with aiohttp.ClientSession(headers=bearer(self.token)) as session:

            async def one(request: dict[str, Any]) -> float:
                async with limit:
                    answer = await request_json(
                        session, "POST", f"{self.judge_url}/score", request,
                        retries=self.retries, describe=describe, outages=self.outages, hints=HINTS,
                    )  # fmt: skip
                if protocol_problem(answer, SCORED) is not None:
                    raise JudgeError(f"{describe}: POST /score answered {answer!r:.200}; expected {{'score': number}}.")
                return float(answer["score"])

            try:
                return list(await asyncio.gather(*(one(r) for r in requests)))
            except ServiceError as exc:
                raise JudgeError(str(exc)) from exc
