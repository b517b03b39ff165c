"""A reference judge server (aiohttp) for ``JudgeReward``, with rule-based scores; ``python -m gpo.rewards.judge_app``.

Rules, as an example to replace with a model or a rubric: an ``event`` scores 1 when the judged turn's action
holds an integer (a well-formed guess), else 0; an ``outcome`` scores 1 when the last turn earned a positive
reward, else 0.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from aiohttp import web

INTEGER = re.compile(r"-?\d+")


def score(request: dict[str, Any]) -> float:
    """The rule-based score of one ``/score`` request."""
    turns = request.get("turns") or []
    if not turns:
        return 0.0
    judged = turns[min(int(request.get("turn", len(turns) - 1)), len(turns) - 1)]
    if request.get("kind") == "event":
        return 1.0 if INTEGER.search(str(judged.get("action", ""))) else 0.0
    return 1.0 if float(turns[-1].get("reward", 0.0)) > 0 else 0.0


def make_app() -> web.Application:
    """``GET /health`` and ``POST /score`` (see ``gpo.rewards.judge``)."""
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    @routes.post("/score")
    async def score_request(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError as exc:
            return web.json_response({"error": f"the body is not JSON: {exc}"}, status=400)
        if not isinstance(body, dict) or body.get("kind") not in ("event", "outcome"):
            return web.json_response({"error": "expected a JSON object with kind 'event' or 'outcome'"}, status=400)
        return web.json_response({"score": score(body)})

    app = web.Application()
    app.add_routes(routes)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpo.rewards.judge_app", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    args = parser.parse_args(argv)
    web.run_app(make_app(), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
