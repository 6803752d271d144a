"""Serve's HTTP proxy gives its freed C heap back to the OS once idle, as the replicas do.

Owns :class:`HeapTrimMiddleware` (an ASGI middleware: each HTTP or websocket request
the proxy serves is work for an :class:`~dsv41.deploy.heap.IdleHeapTrim`),
:func:`proxy_middlewares` (the callback that Serve's proxy calls when it starts) and
:func:`controller_options` (``serve.start``'s options for the Serve controller that
name it, and the Python allocator, in the environment its proxies inherit).

Why: the proxy (Ray's ``ProxyActor``, not a dsv41 deployment) carries every stream's
bytes, and after bench/soak.py's 1,000 concurrent streams glibc held 300 MiB of free
chunks in it, its RSS 125-180 MiB above baseline and still rising round after round
(BENCHMARKS.md, soak). free() gives back only the top of a heap; the pages freed below
live chunks come back only through ``malloc_trim``. glibc's settings in the proxy's
environment do not stand in for it: with fixed thresholds and two arenas
(``GLIBC_TUNABLES=glibc.malloc.trim_threshold=131072:glibc.malloc.mmap_threshold=131072``,
``MALLOC_ARENA_MAX=2``) the soak's proxy kept 98 MiB after one round and gave it back
only when the next round's end happened to free the top of its heap, and the streams
ran slower; trimmed, it is back to 50 MiB above baseline within 10 s of each round.

How, without patching Ray: Serve's proxy (Ray 2.60, ``ray.serve._private.http_util``)
reads :data:`PROXY_CALLBACK_ENV` at its start and wraps its ASGI app in the Starlette
middlewares the named function returns. :func:`controller_options` sets it (and the
idle time) in the controller's ``runtime_env`` ``env_vars`` (``serve.start``'s
``controller_options``, merged with the job's); the proxies the controller creates
inherit its runtime environment. It takes effect when the controller is created: a
Serve instance already running keeps its proxies as they are. Requests Serve's gRPC proxy carries are not counted (dsv41's gRPC service is the
ingress's own listener, whose replica trims itself).

Must not import: ``ray``, ``torch``, ``model``, ``cache``, ``cluster``, ``actors``; from
``deploy`` only ``deploy.heap``.
"""

from __future__ import annotations

import os
from typing import Any, Awaitable, Callable, MutableMapping

from starlette.middleware import Middleware

from dsv41.deploy.heap import IdleHeapTrim, idle_heap_trim, python_allocator_env

# Serve's proxy calls the function this variable names (``module.function``) at its start.
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
# The proxy's idle seconds before it trims (AppArgs' ``heap_trim_idle_s``).
PROXY_IDLE_ENV = "DSV41_PROXY_HEAP_TRIM_IDLE_S"
PROXY_TRIM_THREAD = "dsv41-proxy-heap-trim"
# The request kinds that are work: not ``lifespan``, which lasts as long as the server.
SERVED_SCOPES = ("http", "websocket")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class HeapTrimMiddleware:
    """Holds ``trimmer`` off while a request is served: from its call until the app
    returns, which for a streamed response is after its last chunk was sent."""

    def __init__(self, app: ASGIApp, trimmer: IdleHeapTrim) -> None:
        self.app = app
        self.trimmer = trimmer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in SERVED_SCOPES:
            await self.app(scope, receive, send)
            return
        with self.trimmer.serving():
            await self.app(scope, receive, send)


def controller_options(idle_s: float | None, python_allocator: str) -> dict[str, Any]:
    """``serve.start``'s ``controller_options``: environment variables that make each
    proxy the controller starts use ``python_allocator`` for Python's objects (AppArgs'
    ``python_allocator``: deploy/heap.py) and, unless ``idle_s`` is None (never), trim
    its heap after ``idle_s`` idle seconds (AppArgs' ``heap_trim_idle_s``, validated
    there)."""
    env = python_allocator_env(python_allocator)
    if idle_s is not None:
        env |= {PROXY_CALLBACK_ENV: f"{__name__}.{proxy_middlewares.__name__}", PROXY_IDLE_ENV: repr(float(idle_s))}
    return {"runtime_env": {"env_vars": env}}


def proxy_middlewares() -> list[Middleware]:
    """Serve's proxy callback: the middleware that trims this process's heap after
    :data:`PROXY_IDLE_ENV` idle seconds (none if unset or the process has no glibc heap)."""
    text = os.environ.get(PROXY_IDLE_ENV)
    if text is None:
        return []
    try:
        idle_s = float(text)
    except ValueError:
        raise ValueError(f"{PROXY_IDLE_ENV}: {text!r} (allowed: a positive number of seconds)") from None
    # IdleHeapTrim refuses a number that is not positive, by name.
    trimmer = idle_heap_trim(idle_s, name=PROXY_TRIM_THREAD)
    return [] if trimmer is None else [Middleware(HeapTrimMiddleware, trimmer=trimmer)]
