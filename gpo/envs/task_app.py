"""The reference task app: an ``Environment`` served over HTTP (aiohttp), to run as is or to copy.

``python -m gpo.envs.task_app --port 8001`` serves ``NumberGuess``; ``--env`` names another class by import path and
``--env-args`` its keyword arguments as JSON. The protocol (JSON bodies, JSON answers):

- ``GET /health`` -> ``{"status": "ok", "env": NAME, "episodes": OPEN}``
- ``POST /episodes`` ``{"seed": INT, "task": STR, "id": STR?}`` -> ``{"id": STR, "observation": STR}``. A client-chosen
  ``id`` makes a retried create idempotent: the same id answers the same episode.
- ``POST /episodes/{id}/step`` ``{"action": STR, "turn": INT?}`` -> ``{"observation": STR, "reward": FLOAT,
  "done": BOOL, "info": OBJECT}``. ``turn`` (0, 1, ...) makes a retried step idempotent: the turn just answered is
  answered again from memory; any other turn than the next is refused (409), as is a step after ``done``.
- ``DELETE /episodes/{id}`` -> ``{"id": STR, "closed": true}``.

Errors, each with ``{"error": MESSAGE}``: 400 for a malformed body, 401 without the token (when the app has one),
404 for an unknown episode, 409 for an out-of-order step, 413 for a body above ``--max-body-bytes``, 422 for a task or
action the environment cannot use (its ``reset`` or ``step`` raised ``ValueError``).
A 5xx is the app's own fault (a bug in the environment), which a client may retry.

It listens on 127.0.0.1 unless ``--host`` says otherwise. ``--token`` (or the environment variable
``GPO_TASK_APP_TOKEN``) makes every request need ``Authorization: Bearer TOKEN``; set it whenever the app listens
beyond loopback, and give clients the same value.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gpo.envs.base import Environment, Step, checked_reset, checked_step
from gpo.envs.http import (
    DEFAULT_MAX_BODY_BYTES,
    add_service_arguments,
    json_body,
    json_error,
    service_app,
    service_token,
)
from gpo.envs.number_guess import NumberGuess
from gpo.envs.task_client import TOKEN_ENV


@dataclass
class _Episode:
    env: Environment
    observation: str  # the first one, answered again to a repeated create
    turns: int = 0  # steps answered
    last: Step | None = None  # answer of turn ``turns - 1``


async def _body(
    request: web.Request, required: dict[str, type], optional: dict[str, type] | None = None
) -> dict[str, Any]:
    """The request's JSON object, with each ``required`` key (and each ``optional`` key present) of its type; 400
    otherwise."""
    body = await json_body(request)
    if not isinstance(body, dict):
        raise json_error(web.HTTPBadRequest, "the body must be a JSON object")
    expected = {**required, **{key: kind for key, kind in (optional or {}).items() if key in body}}
    for key, kind in expected.items():
        value = body.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise json_error(web.HTTPBadRequest, f"{key!r} is missing or not of type {kind.__name__}")
    return body


def _unusable(what: str, exc: ValueError) -> web.HTTPException:
    """422: the environment refused a well-formed request (its ``reset`` or ``step`` raised ValueError)."""
    return json_error(web.HTTPUnprocessableEntity, f"the environment cannot use this {what}: {str(exc)[:300]}")


def make_app(
    env: Environment, *, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> web.Application:
    """An aiohttp application serving episodes of ``env`` (one deep copy each) under the protocol above; with
    ``token``, every request must carry it (401 otherwise); bodies above ``max_body_bytes`` are refused (413)."""
    episodes: dict[str, _Episode] = {}
    routes = web.RouteTableDef()

    def find(request: web.Request) -> tuple[str, _Episode]:
        episode_id = request.match_info["id"]
        if episode_id not in episodes:
            raise json_error(web.HTTPNotFound, f"no open episode {episode_id!r}")
        return episode_id, episodes[episode_id]

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "env": type(env).__name__, "episodes": len(episodes)})

    @routes.post("/episodes")
    async def create(request: web.Request) -> web.Response:
        body = await _body(request, {"seed": int, "task": str}, {"id": str})
        episode_id = body.get("id") or uuid.uuid4().hex
        if episode_id not in episodes:
            episode = copy.deepcopy(env)
            try:
                answer = episode.reset(body["seed"], body["task"])
            except ValueError as exc:
                raise _unusable("task or seed", exc) from exc
            try:
                observation = checked_reset(answer, type(episode).__name__)
            except TypeError as exc:  # the served environment's fault: 422, as for a bad step answer
                raise json_error(web.HTTPUnprocessableEntity, str(exc)) from exc
            episodes[episode_id] = _Episode(episode, observation)
        return web.json_response({"id": episode_id, "observation": episodes[episode_id].observation})

    @routes.post("/episodes/{id}/step")
    async def step(request: web.Request) -> web.Response:
        episode_id, episode = find(request)
        body = await _body(request, {"action": str}, {"turn": int})
        turn = body.get("turn", episode.turns)
        if episode.last is not None and turn == episode.turns - 1:  # a retry of the turn just answered
            return web.json_response(episode.last._asdict())
        if turn != episode.turns or (episode.last is not None and episode.last.done):
            state = "is done" if episode.last is not None and episode.last.done else f"expects turn {episode.turns}"
            raise json_error(web.HTTPConflict, f"episode {episode_id!r} {state}; got turn {turn}")
        try:
            answer = episode.env.step(body["action"])
        except ValueError as exc:
            raise _unusable("action", exc) from exc
        try:
            step = checked_step(answer, type(episode.env).__name__)
        except TypeError as exc:  # the served environment's fault: 422, not retried (a retry would step it again)
            raise json_error(web.HTTPUnprocessableEntity, str(exc)) from exc
        episode.last, episode.turns = step, turn + 1
        return web.json_response(episode.last._asdict())

    @routes.delete("/episodes/{id}")
    async def close(request: web.Request) -> web.Response:
        episode_id, episode = find(request)
        del episodes[episode_id]
        episode.env.close()
        return web.json_response({"id": episode_id, "closed": True})

    return service_app(routes, token=token, max_body_bytes=max_body_bytes)


def load_env(path: str, kwargs: dict[str, Any]) -> Environment:
    """``package.module.Class`` (or ``package.Class``) built with ``kwargs``."""
    module, _, name = path.rpartition(".")
    env = getattr(importlib.import_module(module), name)(**kwargs)
    if not isinstance(env, Environment):
        raise TypeError(f"--env {path} is not a gpo.envs.Environment.")
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpo.envs.task_app", description="Serve an environment over HTTP.")
    add_service_arguments(parser, port=8001, token_env=TOKEN_ENV)
    parser.add_argument("--env", default=None, help="import path of an Environment class (default: NumberGuess)")
    parser.add_argument("--env-args", default="{}", help="its keyword arguments as a JSON object")
    args = parser.parse_args(argv)
    kwargs = json.loads(args.env_args)
    env = load_env(args.env, kwargs) if args.env else NumberGuess(**kwargs)
    app = make_app(env, token=service_token(args, TOKEN_ENV), max_body_bytes=args.max_body_bytes)
    web.run_app(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
