"""A gRPC client of dsv41's ``GenerateService``: streams one completion to stdout.

Owns nothing others import except :func:`generate` (one call, its text printed as it
streams). Needs only grpc and the generated ``deploy.proto`` modules; must not import
ray or the rest of the project. Start a server with a gRPC port (``dsv41 serve`` has
one, 9000 by default; from Python, ``build_app({..., "grpc_port": 9000})``), and from
the repository root run::

    python -m dsv41.deploy.examples.grpc_client --address 127.0.0.1:9000 --prompt "hello" \\
        --max-tokens 32 --temperature 0

With a server that has an API key, pass ``--api-key KEY`` (or set ``DSV41_API_KEY``).

The text goes to stdout as it streams; the finish reason and token counts go to
stderr. A refused request exits with status 2 and the server's status and message.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence, TextIO

import grpc

from dsv41.deploy.proto.generate_pb2 import GenerateRequest, GenerateResponse, TokenIds
from dsv41.deploy.proto.generate_pb2_grpc import GenerateServiceStub


def generate(
    address: str, request: GenerateRequest, out: TextIO, *, api_key: str | None = None, timeout_s: float = 300.0
) -> GenerateResponse:
    """Streams ``request``'s text to ``out``; returns the last response (finish reason
    and usage). ``api_key`` goes as ``authorization: Bearer`` metadata."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key is not None else ()
    with grpc.insecure_channel(address) as channel:
        last = GenerateResponse()
        for response in GenerateServiceStub(channel).Generate(request, metadata=metadata, timeout=timeout_s):
            out.write(response.text)
            out.flush()
            last = response
    return last


def _request(args: argparse.Namespace) -> GenerateRequest:
    request = GenerateRequest(model=args.model or "", stop=args.stop, ignore_eos=args.ignore_eos)
    if args.ids is not None:
        request.token_ids.CopyFrom(TokenIds(ids=[int(t) for t in args.ids.split(",")]))
    else:
        request.text = args.prompt
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(request, name, value)
    return request


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:9000", help="host:port of the server's gRPC listener")
    parser.add_argument("--api-key", default=os.environ.get("DSV41_API_KEY"), help="the server's API key (default: $DSV41_API_KEY)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--ids", help="prompt token ids, comma-separated")
    parser.add_argument("--model", default=None, help="served model name (default: the served model)")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    args = parser.parse_args(argv)
    try:
        last = generate(args.address, _request(args), sys.stdout, api_key=args.api_key)
    except grpc.RpcError as error:
        print(f"\n{error.code().name}: {error.details()}", file=sys.stderr)
        return 2
    usage = last.usage
    print(
        f"\n[finish_reason={last.finish_reason} prompt_tokens={usage.prompt_tokens} "
        f"completion_tokens={usage.completion_tokens}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
