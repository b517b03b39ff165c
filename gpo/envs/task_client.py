"""The task app client: episodes of an environment served over HTTP, driven by ``MultiTurnEngine``."""

from __future__ import annotations

import uuid

import aiohttp

from gpo.envs.base import Episodes, Step
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

TOKEN_ENV = "GPO_TASK_APP_TOKEN"  # the shared secret, read by TaskApp and by the reference app (gpo.envs.task_app)
HINTS = {
    401: f"Give the app's token as TaskApp's token or the environment variable {TOKEN_ENV}.",
    413: "The app refused a body this large: raise its --max-body-bytes.",
    422: "The environment refused the task or the policy's action: have its reset/step answer such input (as an "
    "invalid move, say) rather than raise ValueError.",
}


#: The fields an answer must hold, each with the JSON types it may have (checked exactly: a JSON ``true`` is no number)
#: and how the protocol describes them. A step's ``info``, optional, must be an object.
OPENED = {"id": ((str,), "a string"), "observation": ((str,), "a string")}
STEPPED = {
    "observation": ((str,), "a string"),
    "reward": ((int, float), "a finite number"),
    "done": ((bool,), "true or false"),
    "info": ((dict, type(None)), "an object"),
}


class TaskAppError(ServiceError):
    """The task app at ``task_url`` is down, too slow, or answered out of protocol."""


class TaskApp(Episodes):
    """Episodes served by a task app at ``task_url`` (protocol: ``gpo.envs.task_app``).

    Each batch of episodes opens one HTTP session and first waits for ``GET /health`` to answer 200, for at most
    ``health_max_wait_s``: an app that is down fails the rollout before any episode starts, with an error naming
    ``task_url``. Every request has its own timeout; connection errors, timeouts and HTTP 408/429/5xx are retried
    with exponential backoff, any other 4xx is not (the app refused the request itself: the error says why). A
    retried create or step is answered once by the app (the client names the episode, and each step its turn), so
    no episode is created or stepped twice.

    Args:
        task_url: base URL of the task app, e.g. ``http://127.0.0.1:8001``.
        token: shared secret sent as ``Authorization: Bearer TOKEN`` (the app's ``--token``); None: the environment
            variable ``GPO_TASK_APP_TOKEN`` if set, else none. The variable keeps it out of YAML files.
        timeout_s: seconds one request may take.
        attempts: tries per request (1: no retry); None: as many as ``retry_max_s`` allows.
        backoff_s: wait before the first retry, doubled for each further one.
        max_backoff_s: longest wait between tries.
        retry_max_s: longest time a failing request is retried, from its first failure; None: ``attempts`` alone
            bounds it. ``attempts: null`` with ``retry_max_s: 120`` rides out an app unreachable or answering 5xx for
            up to two minutes while its episodes survive (an app restarted with its episodes in memory answers their
            steps 404, which ends the rollout).
        health_max_wait_s: longest wait for ``GET /health`` to answer 200 at the start of each batch.
    """

    def __init__(
        self,
        *,
        task_url: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        attempts: int | None = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        retry_max_s: float | None = None,
        health_max_wait_s: float = 30.0,
    ) -> None:
        if not task_url.startswith(("http://", "https://")):
            raise ValueError(f"task_url={task_url!r} must be an http:// or https:// URL, e.g. http://127.0.0.1:8001.")
        if not health_max_wait_s > 0:
            raise ValueError(f"health_max_wait_s={health_max_wait_s} must be > 0 (seconds to wait for GET /health).")
        self.task_url = task_url.rstrip("/")
        self.token = token_from(token, TOKEN_ENV)
        self.retries = Retries(timeout_s=timeout_s, attempts=attempts, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                               retry_max_s=retry_max_s)  # fmt: skip
        self.health_max_wait_s = health_max_wait_s
        self.outages = Outages()
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> TaskApp:
        self._session = aiohttp.ClientSession(headers=bearer(self.token))
        try:
            await wait_healthy(
                self._session, f"{self.task_url}/health", max_wait_s=self.health_max_wait_s,
                timeout_s=self.retries.timeout_s, describe=self._describe, hints=HINTS,
            )  # fmt: skip
        except ServiceError as exc:
            await self.__aexit__()
            raise TaskAppError(str(exc)) from exc
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(self, seed: int, task: str) -> tuple[str, str]:
        episode = uuid.uuid4().hex
        answer = await self._call("POST", "/episodes", {"id": episode, "seed": seed, "task": task}, OPENED)
        return answer["id"], answer["observation"]

    async def step(self, episode: str, action: str, turn: int) -> Step:
        answer = await self._call("POST", f"/episodes/{episode}/step", {"action": action, "turn": turn}, STEPPED)
        return Step(answer["observation"], float(answer["reward"]), answer["done"], answer.get("info") or {})

    async def close(self, episode: str) -> None:
        await self._call("DELETE", f"/episodes/{episode}", ok_status=frozenset({404}))  # already gone: closed

    async def _call(self, method: str, path: str, payload=None, fields=None, ok_status=frozenset()):
        """The app's JSON answer to ``method path``, checked against ``fields`` (``OPENED``, ``STEPPED``) if given."""
        if self._session is None:
            raise RuntimeError("TaskApp is used outside `async with` (MultiTurnEngine opens it).")
        try:
            answer = await request_json(
                self._session, method, self.task_url + path, payload,
                retries=self.retries, describe=self._describe, outages=self.outages, ok_status=ok_status,
                hints=HINTS,
            )  # fmt: skip
        except ServiceError as exc:
            raise TaskAppError(str(exc)) from exc
        problem = protocol_problem(answer, fields) if fields else None
        if problem:
            raise TaskAppError(f"{self._describe}: {method} {path} answered {answer!r:.200}; {problem}.")
        return answer

    @property
    def _describe(self) -> str:
        return (
            f"task app at task_url={self.task_url} (is it running and reachable? the reference app: "
            "python -m gpo.envs.task_app --port PORT)"
        )
