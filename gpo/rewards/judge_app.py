"""A reference judge server (aiohttp) for ``JudgeReward``, with rule-based scores; ``python -m gpo.rewards.judge_app``.

Rules, as an example to replace with a model or a rubric: an ``event`` scores 1 when the judged turn's action
holds an integer (a well-formed guess), else 0; an ``outcome`` scores 1 when the last turn earned a positive
reward, else 0.

Errors, each with ``{"error": MESSAGE}``: 400 for a body that is not a ``/score`` request (see ``gpo.rewards.judge``),
401 without the token (when the judge has one), 413 for a body above ``--max-body-bytes``; a 5xx is the judge's own
fault. It listens on 127.0.0.1 unless ``--host`` says otherwise; ``--token`` (or the environment variable
``GPO_JUDGE_TOKEN``) makes every request need ``Authorization: Bearer TOKEN``.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from aiohttp import web

from gpo.envs.http import (
    DEFAULT_MAX_BODY_BYTES,
    add_service_arguments,
    json_body,
    json_error,
    service_app,
    service_token,
)
from gpo.rewards.judge import TOKEN_ENV

INTEGER = re.compile(r"-?\d+")


def problem(request: Any) -> str | None:
    """What makes ``request`` unusable as a ``/score`` request; None when it is usable."""
    if not isinstance(request, dict):
        return "the body must be a JSON object"
    if request.get("kind") not in ("event", "outcome"):
        return "'kind' must be 'event' or 'outcome'"
    turns = request.get("turns", [])
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return "'turns' must be a list of objects"
    for k, t in enumerate(turns):
        if not isinstance(t.get("action", ""), str):
            return f"turns[{k}].action must be a string"
        if not _is_number(t.get("reward", 0.0)):
            return f"turns[{k}].reward must be a number"
    turn = request.get("turn", len(turns) - 1)
    if not (isinstance(turn, int) and not isinstance(turn, bool)) or (turns and not 0 <= turn < len(turns)):
        return f"'turn' must be an integer in [0, {len(turns)}) (the judged turn)"
    return None


def score(request: dict[str, Any]) -> float:
    """The rule-based score of one ``/score`` request (one ``problem`` accepts)."""
    turns = request.get("turns", [])
    if not turns:
        return 0.0
    if request["kind"] == "event":
        return 1.0 if INTEGER.search(turns[request.get("turn", len(turns) - 1)].get("action", "")) else 0.0
    return 1.0 if turns[-1].get("reward", 0.0) > 0 else 0.0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def make_app(*, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    """``GET /health`` and ``POST /score`` (see ``gpo.rewards.judge``); with ``token``, every request must carry it
    (401 otherwise); bodies above ``max_body_bytes`` are refused (413)."""
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    @routes.post("/score")
    async def score_request(request: web.Request) -> web.Response:
        body = await json_body(request)
        unusable = problem(body)
        if unusable is not None:
            raise json_error(web.HTTPBadRequest, unusable)
        return web.json_response({"score": score(body)})

    return service_app(routes, token=token, max_body_bytes=max_body_bytes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpo.rewards.judge_app", description=__doc__)
    add_service_arguments(parser, port=8002, token_env=TOKEN_ENV)
    args = parser.parse_args(argv)
    app = make_app(token=service_token(args, TOKEN_ENV), max_body_bytes=args.max_body_bytes)
    web.run_app(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
