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

Errors: 400 for a malformed body, 404 for an unknown episode, 409 for an out-of-order step, each with
``{"error": MESSAGE}``.
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

from gpo.envs.base import Environment, Step
from gpo.envs.number_guess import NumberGuess


@dataclass
class _Episode:
    env: Environment
    observation: str  # the first one, answered again to a repeated create
    turns: int = 0  # steps answered
    last: Step | None = None  # answer of turn ``turns - 1``


def _error(status: type[web.HTTPException], message: str) -> web.HTTPException:
    return status(text=json.dumps({"error": message}), content_type="application/json")


async def _body(request: web.Request, required: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise _error(web.HTTPBadRequest, f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _error(web.HTTPBadRequest, "the body must be a JSON object")
    for key, kind in required.items():
        if not isinstance(body.get(key), kind):
            raise _error(web.HTTPBadRequest, f"{key!r} is missing or not of type {kind}")
    return body


def make_app(env: Environment) -> web.Application:
    """An aiohttp application serving episodes of ``env`` (one deep copy each) under the protocol above."""
    episodes: dict[str, _Episode] = {}
    routes = web.RouteTableDef()

    def find(request: web.Request) -> tuple[str, _Episode]:
        episode_id = request.match_info["id"]
        if episode_id not in episodes:
            raise _error(web.HTTPNotFound, f"no open episode {episode_id!r}")
        return episode_id, episodes[episode_id]

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "env": type(env).__name__, "episodes": len(episodes)})

    @routes.post("/episodes")
    async def create(request: web.Request) -> web.Response:
        body = await _body(request, {"seed": int, "task": str})
        episode_id = str(body.get("id") or uuid.uuid4().hex)
        if episode_id not in episodes:
            episode = copy.deepcopy(env)
            episodes[episode_id] = _Episode(episode, episode.reset(body["seed"], body["task"]))
        return web.json_response({"id": episode_id, "observation": episodes[episode_id].observation})

    @routes.post("/episodes/{id}/step")
    async def step(request: web.Request) -> web.Response:
        episode_id, episode = find(request)
        body = await _body(request, {"action": str})
        turn = body.get("turn", episode.turns)
        if episode.last is not None and turn == episode.turns - 1:  # a retry of the turn just answered
            return web.json_response(episode.last._asdict())
        if turn != episode.turns or (episode.last is not None and episode.last.done):
            state = "is done" if episode.last is not None and episode.last.done else f"expects turn {episode.turns}"
            raise _error(web.HTTPConflict, f"episode {episode_id!r} {state}; got turn {turn}")
        observation, reward, done, info = episode.env.step(body["action"])
        episode.last, episode.turns = Step(str(observation), float(reward), bool(done), dict(info)), turn + 1
        return web.json_response(episode.last._asdict())

    @routes.delete("/episodes/{id}")
    async def close(request: web.Request) -> web.Response:
        episode_id, episode = find(request)
        del episodes[episode_id]
        episode.env.close()
        return web.json_response({"id": episode_id, "closed": True})

    app = web.Application()
    app.add_routes(routes)
    return app


def load_env(path: str, kwargs: dict[str, Any]) -> Environment:
    """``package.module.Class`` (or ``package.Class``) built with ``kwargs``."""
    module, _, name = path.rpartition(".")
    env = getattr(importlib.import_module(module), name)(**kwargs)
    if not isinstance(env, Environment):
        raise TypeError(f"--env {path} is not a gpo.envs.Environment.")
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpo.envs.task_app", description="Serve an environment over HTTP.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--env", default=None, help="import path of an Environment class (default: NumberGuess)")
    parser.add_argument("--env-args", default="{}", help="its keyword arguments as a JSON object")
    args = parser.parse_args(argv)
    kwargs = json.loads(args.env_args)
    env = load_env(args.env, kwargs) if args.env else NumberGuess(**kwargs)
    web.run_app(make_app(env), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
