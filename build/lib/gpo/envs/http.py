"""JSON over HTTP with a timeout per request and retries with exponential backoff, for task apps and judges."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp

RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # the service may answer if asked again


class ServiceError(RuntimeError):
    """A task app or judge did not answer usably after its retries, or refused a request."""


@dataclass(frozen=True)
class Retries:
    """How a request is retried: ``attempts`` tries in all, waiting ``min(backoff_s * 2**k, max_backoff_s)`` before
    try ``k + 2``. Connection errors, timeouts and HTTP 408/429/5xx are retried; other 4xx answers are not.

    Args:
        timeout_s: seconds one try may take, connecting included.
        attempts: tries per request (1: no retry).
        backoff_s: wait before the first retry; doubled for each further one.
        max_backoff_s: longest wait between tries.
    """

    timeout_s: float = 30.0
    attempts: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 (seconds one request may take).")
        if self.attempts < 1:
            raise ValueError(f"attempts={self.attempts} must be >= 1 (tries per request; 1: no retry).")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"backoff_s={self.backoff_s} and max_backoff_s={self.max_backoff_s} must be >= 0.")

    def wait(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0, 1, ...)."""
        return min(self.backoff_s * 2**retry, self.max_backoff_s)


async def request_json(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    payload: Any = None,
    *,
    retries: Retries,
    describe: str,
    ok_status: frozenset[int] = frozenset(),
) -> Any:
    """``method url`` with JSON ``payload``; returns the decoded JSON answer (None for an empty one, or for a status
    in ``ok_status``). Raises ``ServiceError`` starting with ``describe`` (which service, at which URL) and saying
    what the last try got."""
    last = "no try made"
    for attempt in range(retries.attempts):
        if attempt:
            await asyncio.sleep(retries.wait(attempt - 1))
        try:
            timeout = aiohttp.ClientTimeout(total=retries.timeout_s)
            async with session.request(method, url, json=payload, timeout=timeout) as response:
                if response.status in ok_status:
                    return None
                body = await response.text()
                if response.status in RETRIED_STATUS:
                    last = f"HTTP {response.status}: {body[:200]}"
                    continue
                if response.status >= 400:
                    raise ServiceError(
                        f"{describe}: {method} {url} was refused with HTTP {response.status}: {body[:500]}"
                    )
                return await response.json(content_type=None) if body else None
        except TimeoutError:
            last = f"no answer within timeout_s={retries.timeout_s}"
        except aiohttp.ClientConnectionError as exc:
            last = f"connection failed ({type(exc).__name__}: {exc})"
        except (aiohttp.ContentTypeError, ValueError) as exc:
            raise ServiceError(f"{describe}: {method} {url} answered with something that is not JSON ({exc}).") from exc
    raise ServiceError(f"{describe}: {method} {url} failed after {retries.attempts} attempt(s); the last: {last}.")
