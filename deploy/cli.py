"""The ``dsv41`` command line: make-tiny, train-tiny, logits, generate, geometry, plan, validate, bench, serve.

Owns argument parsing and printing only; every command calls the package's public
Python interfaces (model.tiny, model.training, model.loader, cluster.engine, cluster.pool_layout,
cluster.memory_plan).
Heavy imports happen inside the command that needs them, so ``dsv41 --help`` is fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from dsv41.cluster.validate import ReplicaFactory, ReplicaShape
    from dsv41.deploy.app_args import AppArgs

from dsv41.cluster.cuda_graphs import CUDAGRAPH_MODES
from dsv41.model.loader import WEIGHT_STORAGE
from dsv41.model.tiny import embedded_model_dir

SERVE_APP_NAME = "dsv41"
# Seconds `dsv41 serve` waits for every replica to run: loading a large checkpoint takes
# minutes, and a cluster without the resources a replica asks for never places it.
DEFAULT_START_TIMEOUT_S = 600.0
# What `dsv41 serve` listens on unless --host (or the config) says otherwise.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT = 8000, 9000
API_KEY_ENV = "DSV41_API_KEY"
# Ray's token authentication (Ray 2.60): the mode's variable, and where `ray.init` of a
# new cluster writes the token that drivers of the same user read.
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_TOKEN_FILE = "~/.ray/auth_token"


def _ray_runtime_env() -> dict[str, dict[str, str]]:
    """Ray workers import what the driver's PYTHONPATH adds (where the workers' own
    dependencies, or a checkout's dsv41, may live); dsv41 itself is installed."""
    path = os.environ.get("PYTHONPATH", "")
    return {"env_vars": {"PYTHONPATH": path}} if path else {}


def _model_dir(arg: str | None) -> Path:
    return Path(arg) if arg else default_model_dir()


def default_model_dir() -> Path:
    """The embedded model (model/tiny.py), or the CLI's exit with why it is missing."""
    try:
        return embedded_model_dir()
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from exc


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _read_ids(path: str) -> dict[str, list[int]]:
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and v and all(isinstance(t, int) for t in v) for v in raw.values()
    ):
        raise SystemExit(f"{path}: expected a JSON object mapping names to non-empty lists of token ids")
    return raw


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} (allowed: a finite number > 0)")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} (allowed: an integer >= 1)")
    return value


# Byte units a size may carry: decimal (GB = 10**9, as device sheets print them) and binary.
_BYTE_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _byte_count(text: str) -> int:
    """A positive byte count: an integer, or a number with a unit (141GB, 139.5GiB)."""
    stripped = text.strip()
    digits = stripped.rstrip("KMGTiB")
    units = {unit.upper(): factor for unit, factor in _BYTE_UNITS.items()}
    try:
        value = float(digits) * units[stripped[len(digits) :].upper()]
    except (KeyError, ValueError):
        value = math.nan
    if not 1 <= value < math.inf:
        raise argparse.ArgumentTypeError(
            f"{text!r} (allowed: a positive number of bytes, optionally with a unit: {', '.join(u for u in _BYTE_UNITS if u)})"
        )
    return int(value)


def _chunk_sizes(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    sizes = tuple(int(s) for s in text.split(","))
    if any(s <= 0 for s in sizes):
        raise SystemExit("--chunk-sizes: every size must be a positive integer")
    return sizes


def cmd_make_tiny(args: argparse.Namespace) -> None:
    from dsv41.model.tiny import TINY, TINY_ALT, make_tiny

    spec = {"tiny": TINY, "tiny-alt": TINY_ALT}[args.preset]
    out = make_tiny(Path(args.dir), quantized=args.quantized, seed=args.seed, spec=spec)
    print(out)


def cmd_train_tiny(args: argparse.Namespace) -> None:
    from dsv41.model.training import train_tiny

    report = train_tiny(Path(args.dir), minutes=args.minutes, seed=args.seed)
    for name, phase in (("target", report.target), ("DSpark", report.dspark)):
        print(
            f"{name}: {phase.steps} steps, {phase.tokens} tokens in {phase.seconds:.0f} s, "
            f"loss {phase.first_loss:.3f} -> {phase.last_loss:.3f}"
        )
    print(args.dir)


def cmd_logits(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    ids = _read_ids(args.ids)
    model_dir = _model_dir(args.model)
    out = {}
    if args.runtime == "reference":
        from dsv41.model.params import load_model_params
        from dsv41.model.reference import ReferenceModel

        reference = ReferenceModel(load_model_params(model_dir, dtype=_dtype(args.dtype))[0])
        for name, seq in ids.items():
            out[name] = reference.forward(seq).logits.float().contiguous()
    else:
        from dsv41.cluster.engine import Engine

        engine = Engine.from_pretrained(model_dir, dtype=_dtype(args.dtype), enable_prefix_caching=False)
        sizes = _chunk_sizes(args.chunk_sizes)
        for name, seq in ids.items():
            out[name] = engine.prompt_logits(seq, chunk_sizes=sizes).logits.contiguous()
    save_file(out, args.out)
    print(f"wrote {len(out)} logits tensor(s) to {args.out}")


def cmd_generate(args: argparse.Namespace) -> None:
    from dsv41.cluster.options import EngineError, check_replica_options, engine_options
    from dsv41.cluster.sampling_params import SamplingParams
    from dsv41.model.source import ModelSource

    if args.dp < 1:
        raise SystemExit("--dp: must be a positive integer")
    model_dir = _model_dir(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    options = _runtime_options(args)
    if args.enable_tbo == "prefill":
        options["enable_tbo_prefill"] = True
    if args.tbo_prefill_min_tokens is not None:
        options["tbo_prefill_min_tokens"] = args.tbo_prefill_min_tokens
    try:
        # Before Ray starts or a weight is read.
        parsed = engine_options(options)
        check_replica_options(ModelSource.parse(model_dir).config(), parsed, args.dp)
        if args.backend == "ray":
            from dsv41.actors.engine_group import check_group_options

            check_group_options(parsed)
    except EngineError as exc:
        raise SystemExit(f"dsv41 generate: {exc}") from exc
    if args.backend == "ray":
        import ray

        from dsv41.actors.engine_group import EngineGroup

        # Workers import the project from where this CLI runs it.
        ray.init(runtime_env=_ray_runtime_env())
        try:
            with EngineGroup(str(model_dir), dp=args.dp, **options) as group:
                _generate(args, group.generate, _tokenizer(model_dir), params)
        finally:
            ray.shutdown()
        return
    if args.dp > 1:
        from dsv41.cluster.engine import Engine
        from dsv41.cluster.ranks import DPLayout

        engine = Engine.in_process(model_dir, DPLayout(args.dp), **options)
    else:
        from dsv41.cluster.engine import Engine

        engine = Engine.from_pretrained(model_dir, **options)
    _generate(args, engine.generate, engine.tokenizer, params)


def _runtime_options(args: argparse.Namespace) -> dict[str, object]:
    """The engine options of how the runtime runs that generate, validate and serve
    share: --method / --num-speculative-tokens, --cudagraph-mode, --weight-storage,
    --fp8-activations and --async-scheduling (none when not given)."""
    options: dict[str, object] = {}
    if args.method is not None:
        options["speculative_method"] = args.method
    if args.num_speculative_tokens is not None:
        options["num_speculative_tokens"] = args.num_speculative_tokens
    if args.cudagraph_mode is not None:
        options["cudagraph_mode"] = args.cudagraph_mode
    if args.weight_storage is not None:
        options["weight_storage"] = args.weight_storage
    if args.fp8_activations:
        options["fp8_activations"] = True
    if args.async_scheduling:
        options["async_scheduling"] = True
    return options


def _add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule and launch each step while the previous one runs on the device (ranks in process: one, or "
        "--dp N in threads; not with --backend ray, speculation or an offload store)",
    )
    p.add_argument("--method", choices=("dspark",), default=None, help="speculative decoding: DSpark (the mtp stages)")
    p.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="drafts per step (default with --method dspark: 5)"
    )
    p.add_argument(
        "--cudagraph-mode",
        choices=CUDAGRAPH_MODES,
        default=None,
        help="none (eager), full (each decode step one CUDA graph replay) or tr_hybrid (every step's token-wise "
        "parts replayed from per-layer graphs, attention eager between them); graphs need the Triton kernels on "
        "CUDA (default none)",
    )
    p.add_argument(
        "--weight-storage",
        choices=WEIGHT_STORAGE,
        default=None,
        help="stored (default: a quantised checkpoint's FP8 / FP4 weights stay in its bytes, decoded in each kernel) "
        "or decoded (the compute dtype, 2-4x the bytes)",
    )
    p.add_argument(
        "--fp8-activations",
        action="store_true",
        help="quantise the inputs of the projections through FP8 weights to FP8 E4M3 per token and 32 channels (the "
        "rounded rows go through the usual bf16 GEMMs); logits then differ from the reference's within the bound "
        "bench.stored_parity --fp8-activations measures (default: off, the compute dtype)",
    )


def _tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    from dsv41.model.loader import TOKENIZER_FILE

    return Tokenizer.from_file(str(model_dir / TOKENIZER_FILE))


def _generate(args: argparse.Namespace, generate, tokenizer, params) -> None:
    if args.ids:
        prompts = _read_ids(args.ids)
    else:
        prompts = {"prompt": tokenizer.encode(args.prompt).ids}
    outputs = generate(list(prompts.values()), params)
    if args.json:
        print(json.dumps({name: list(o.token_ids) for name, o in zip(prompts, outputs)}))
    else:
        for name, o in zip(prompts, outputs):
            text = tokenizer.decode(list(o.token_ids), skip_special_tokens=False)
            print(f"[{name}] ({o.finish_reason}, {len(o.token_ids)} tokens) {text}")


def cmd_geometry(args: argparse.Namespace) -> None:
    from dsv41.cluster.pool_layout import pool_geometry
    from dsv41.model.config import V41Config

    config = V41Config.from_pretrained(_model_dir(args.model), text_only=True)
    geometry = pool_geometry(
        config,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        index_cache_dtype=args.index_cache_dtype,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    print(geometry.describe())


def cmd_plan(args: argparse.Namespace) -> None:
    from dsv41.cluster.memory_plan import PlanError, plan_memory
    from dsv41.cluster.options import engine_options
    from dsv41.cluster.ranks import DPLayout
    from dsv41.model.config import ConfigError
    from dsv41.model.loader import CheckpointError
    from dsv41.model.source import ModelSource, ModelSourceError

    model = args.model or str(default_model_dir())
    try:
        source = ModelSource.parse(model)
    except ModelSourceError as exc:
        raise SystemExit(f"dsv41 plan: --model: {exc}") from exc
    if source.checkpoint_dir is not None and not source.checkpoint_dir.is_dir():
        raise SystemExit(
            f"dsv41 plan: --model: {model} is not a directory (allowed: a checkpoint directory, a directory holding "
            "a config.json, or generated:<slice>)"
        )
    given = {
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_dtype": args.kv_cache_dtype,
        "index_cache_dtype": args.index_cache_dtype,
        "gpu_memory_bytes": args.gpu_memory,
        "gpu_memory_reserve_bytes": args.gpu_memory_reserve,
        "dtype": _dtype(args.dtype),
        "weight_storage": args.weight_storage,
    }
    # The engine's own defaults for what is not given.
    options = {name: value for name, value in given.items() if value is not None}
    try:
        plan = plan_memory(source, DPLayout(args.dp, args.expert_mode), engine_options(options))
    except (PlanError, ConfigError, CheckpointError) as exc:
        raise SystemExit(f"dsv41 plan: --model {model}: {exc}") from exc
    print(plan.render())


def cmd_validate(args: argparse.Namespace) -> None:
    from dsv41.cluster.validate import ReplicaShape, ValidationError, run_validation

    if args.fp8_activations:
        raise SystemExit(
            "dsv41 validate: --fp8-activations: validation holds the engine to the reference's arithmetic, whose "
            "activations are unquantised (measure FP8 activations' difference with bench.stored_parity "
            "--fp8-activations)"
        )
    model = args.model or default_model_dir()
    on_ray = args.backend == "ray"
    if on_ray:
        kind, backend = "ray", "nccl" if args.device == "cuda" else "gloo"
    else:
        kind, backend = "engine" if args.dp == 1 else "threads", "gloo"
    try:
        shape = ReplicaShape(
            kind=kind,
            dp=args.dp,
            expert_mode=args.expert_mode,
            backend=backend,
            device=args.device,
            kernel_backend=args.kernel_backend,
            batch_invariant=args.batch_invariant,
            dtype=args.dtype,
            speculative_method=args.method,
            num_speculative_tokens=args.num_speculative_tokens,
            cudagraph_mode=args.cudagraph_mode or "none",
            weight_storage=args.weight_storage or "stored",
        )
        with _ray_validation_groups(model, shape) if on_ray else nullcontext(None) as factory:
            report = run_validation(
                model,
                shape=shape,
                factory=factory,
                scenarios=args.scenarios.split(",") if args.scenarios else None,
                progress=lambda line: print(line, file=sys.stderr),
                block_size=args.block_size,
            )
    except ValidationError as exc:
        raise SystemExit(f"dsv41 validate: {exc}") from exc
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(f"{'PASS' if report['passed'] else 'FAIL'}: report written to {args.output}")
    if not report["passed"]:
        raise SystemExit(1)


@contextmanager
def _ray_validation_groups(model: str | Path, shape: ReplicaShape) -> Iterator[ReplicaFactory]:
    """The factory of the validation's engine groups: a fresh group of ``shape.dp``
    ranks per scenario (on CUDA one GPU per rank). Starts Ray for the run, and stops
    it after, if it is not up."""
    import itertools

    import ray

    from dsv41.actors.engine_group import EngineGroup
    from dsv41.actors.group import GroupOptions

    group_options = GroupOptions(rank_num_gpus=1) if shape.device == "cuda" else GroupOptions()
    groups = itertools.count()

    def group(options: dict[str, object]) -> EngineGroup:
        # A name per scenario: the previous group's named rank actors may still be dying.
        return EngineGroup(
            str(model),
            dp=shape.dp,
            expert_mode=shape.expert_mode,
            backend=shape.backend,
            group_options=group_options,
            name=f"dsv41-validate-{next(groups)}",
            **options,
        )

    started = not ray.is_initialized()
    if started:
        # Enough logical CPUs for every rank's bundle even on a box with fewer cores;
        # workers import the project from where this CLI runs it.
        ray.init(
            num_cpus=max(os.cpu_count() or 1, math.ceil(shape.dp * group_options.rank_num_cpus)),
            include_dashboard=False,
            runtime_env=_ray_runtime_env(),
        )
    try:
        yield group
    finally:
        if started:
            ray.shutdown()


def cmd_bench(args: argparse.Namespace) -> None:
    from dsv41.deploy.bench import run_bench_command

    run_bench_command(args)


def _serve_settings(args: argparse.Namespace) -> tuple[str, int, str, dict[str, object]]:
    """HTTP host, HTTP port, route prefix and the application's args of `dsv41 serve`:
    the flags, else the config's values (the HTTP host only where the config sets it:
    Serve's own default is every interface), else the defaults, which listen on
    loopback only. The API key: --api-key, else $DSV41_API_KEY, else the config's."""
    from dsv41.deploy.app_args import read_serve_config

    host, port, route_prefix, app_args = None, DEFAULT_HTTP_PORT, "/", {}
    if args.config:
        try:
            config, application = read_serve_config(args.config)
        except ValueError as exc:
            raise SystemExit(f"--config: {exc}") from exc
        if config.grpc_options.grpc_servicer_functions:
            raise SystemExit(
                f"--config: {args.config} sets grpc_options.grpc_servicer_functions: Serve's gRPC proxy listens on "
                "every interface; the application serves gRPC itself (allowed: the application's grpc_port arg)"
            )
        if "host" in config.http_options.model_fields_set:
            host = config.http_options.host
        port = config.http_options.port
        route_prefix, app_args = application.route_prefix or "/", dict(application.args or {})
    host = args.host or host or DEFAULT_HOST
    port = args.port if args.port is not None else port
    app_args["grpc_port"] = args.grpc_port if args.grpc_port is not None else app_args.get("grpc_port", DEFAULT_GRPC_PORT)
    if args.host or "grpc_host" not in app_args:
        app_args["grpc_host"] = host
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or app_args.get("api_key")
    if api_key:
        app_args["api_key"] = api_key
    if args.max_body_bytes is not None:
        app_args["limits"] = {**app_args.get("limits", {}), "max_body_bytes": args.max_body_bytes}
    if args.auth_all_routes:
        app_args["public_routes"] = []
    if not (args.model or app_args.get("model")):
        from dsv41.deploy.app_args import TINY_MODEL_NAME

        # The embedded model's name, not its directory's ("tiny-trained"), as the YAML's.
        app_args.setdefault("served_model_name", TINY_MODEL_NAME)
    runtime = _runtime_options(args)
    if runtime:
        app_args["engine"] = {**app_args.get("engine", {}), **runtime}
    # Made here, once, rather than by replicas racing to write the same directory.
    app_args["model"] = args.model or app_args.get("model") or str(default_model_dir())
    return host, port, route_prefix, app_args


def cmd_serve(args: argparse.Namespace) -> None:
    import signal
    import time

    import ray
    from ray import serve

    from dsv41.deploy.app import AppStartFailed, AppStartTimeout, build_app, run_app
    from dsv41.deploy.app_args import AppArgs
    from dsv41.deploy.proxy_heap import controller_options

    host, port, route_prefix, app_args = _serve_settings(args)
    try:
        parsed = AppArgs.from_dict(app_args)
    except ValueError as exc:
        raise SystemExit(f"dsv41 serve: {exc}") from exc

    # A cluster of its own ("local"): never one that RAY_ADDRESS or `ray start` left on
    # the machine. Replicas import the project from this checkout, whatever else is installed.
    ray.init(address="local", include_dashboard=False, runtime_env=_ray_runtime_env())
    # After ray.init, which installs its own SIGTERM handler (one that aborts the process).
    # The handler takes no lock: one that did (Event.set) deadlocked when a second signal
    # landed while the first handler held it (seen with Ctrl-C twice). While the
    # application starts, the first signal interrupts the start; later ones, and every
    # one once it serves, are only recorded, so none cuts the shutdown short.
    received: list[int] = []
    starting = True

    def on_signal(signum: int, _frame: object) -> None:
        interrupt_start = starting and not received
        received.append(signum)
        if interrupt_start:
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    try:
        waiting = f"up to {args.start_timeout:g} s for its replicas to run"
        print(f"starting {parsed.model_name}: {waiting} ...", file=sys.stderr, flush=True)
        try:
            # Serve's proxy trims its heap when idle, as the replicas do (deploy/proxy_heap.py).
            serve.start(http_options={"host": host, "port": port}, controller_options=controller_options(parsed.heap_trim_idle_s, parsed.python_allocator))
            handle = run_app(build_app(parsed), name=SERVE_APP_NAME, route_prefix=route_prefix, timeout_s=args.start_timeout)
            grpc_address = handle.grpc_address.remote().result(timeout_s=args.start_timeout)
        except (AppStartTimeout, AppStartFailed) as exc:
            raise SystemExit(f"dsv41 serve: {exc}") from exc
        except KeyboardInterrupt:
            raise SystemExit(f"dsv41 serve: {signal.Signals(received[0]).name} before the application was running") from None
        starting = False
        _print_serving(parsed, host, port, route_prefix, grpc_address)
        _print_ray_connection(ray.get_runtime_context().gcs_address)
        while not received:
            time.sleep(0.2)
        print("shutting down ...", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


def _print_serving(parsed: "AppArgs", host: str, port: int, route_prefix: str, grpc_address: str | None) -> None:
    """What `dsv41 serve` listens on, read back from the sockets the machine holds."""
    from dsv41.deploy.procfs import listening_addresses

    base = f"http://{host}:{port}{route_prefix.rstrip('/')}/v1"
    bound = ", ".join(listening_addresses(port)) or "no socket found"
    print(f"serving {parsed.model_name} at {base} (Ctrl-C to stop); HTTP listening on {bound}", flush=True)
    auth = " -H 'Authorization: Bearer $DSV41_API_KEY'" if parsed.api_key else ""
    body = json.dumps({"model": parsed.model_name, "prompt": "hello", "max_tokens": 8})
    print(f"  try: curl {base}/completions{auth} -H 'Content-Type: application/json' -d '{body}'", flush=True)
    if grpc_address is not None:
        grpc_port = int(grpc_address.rpartition(":")[2])
        grpc_bound = ", ".join(listening_addresses(grpc_port)) or "no socket found"
        print(f"gRPC (dsv41.GenerateService/Generate) listening on {grpc_bound}; try:", flush=True)
        print(f"  python -m dsv41.deploy.examples.grpc_client --address {grpc_address} --prompt hello", flush=True)
    if parsed.api_key:
        public = ", ".join(parsed.public_routes) or "none"
        print(f"an API key is required (Authorization: Bearer KEY) on every route but: {public}", flush=True)


def _print_ray_connection(gcs_address: str) -> None:
    """How a Python driver reaches the application through a DeploymentHandle: the Ray
    address, and the token authentication a cluster Ray 2.60 starts has on by default
    (a driver given an explicit address enables it only with RAY_AUTH_MODE=token)."""
    token_auth = os.environ.get(RAY_AUTH_MODE_ENV, "").lower() == "token"
    print(f"Ray cluster at {gcs_address} (started by this command; it stops with it); a Python handle:", flush=True)
    code = (
        f"import ray; from dsv41.deploy.client import generate, llm_handle; ray.init(address={gcs_address!r}); "
        f"print(generate(llm_handle({SERVE_APP_NAME!r}), 'hello', max_tokens=8))"
    )
    print(f"  {'RAY_AUTH_MODE=token ' if token_auth else ''}python3 -c \"{code}\"", flush=True)
    if token_auth:
        print(f"  (token auth: the driver reads the token from {RAY_TOKEN_FILE} or $RAY_AUTH_TOKEN)", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1 on a paged runtime")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write the embedded tiny checkpoint (official format)")
    p.add_argument("dir")
    p.add_argument("--quantized", action="store_true", help="FP8/FP4 weights with E8M0 scales")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", choices=("tiny", "tiny-alt"), default="tiny")
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser(
        "train-tiny", help="train the tiny model (target and DSpark stages) on the Python standard library's sources"
    )
    p.add_argument("dir")
    p.add_argument("--minutes", type=_positive_number, default=12.0, help="wall-clock training budget (default: 12)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_train_tiny)

    p = sub.add_parser("logits", help="full-sequence logits of token-id prompts")
    p.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--ids", required=True, help="JSON object: name -> list of token ids")
    p.add_argument("--out", required=True, help="output .safetensors, one float32 [len, vocab] per name")
    p.add_argument("--runtime", choices=("reference", "paged"), default="reference")
    p.add_argument("--chunk-sizes", help="paged only: prefill chunk sizes, cycling (e.g. 3,1,129,7,128)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("generate", help="generate tokens for a prompt")
    p.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--ids", help="JSON object: name -> list of token ids")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print {name: token ids} as JSON")
    p.add_argument("--backend", choices=("local", "ray"), default="local", help="ranks in this process, or Ray actors")
    p.add_argument("--dp", type=int, default=1, help="data-parallel attention ranks (experts sharded over them)")
    _add_runtime_arguments(p)
    p.add_argument(
        "--enable-tbo",
        choices=("prefill",),
        default=None,
        help="prefill two-batch overlap: each rank's prefill steps run as two microbatches, one's MoE collectives "
        "overlapping the other's compute (needs --dp >= 2)",
    )
    p.add_argument(
        "--tbo-prefill-min-tokens",
        type=int,
        default=None,
        help="with --enable-tbo prefill: split a step only when every rank has at least this many rows",
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("geometry", help="print the PAGE/STATE plane table and bytes")
    p.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--kv-cache-dtype", choices=("bf16", "fp4"), default="bf16")
    p.add_argument("--index-cache-dtype", choices=("fp8", "fp4"), default="fp8")
    p.add_argument("--num-speculative-tokens", type=int, default=0)
    p.set_defaults(func=cmd_geometry)

    p = sub.add_parser(
        "plan", help="per-rank memory plan: device weights by kind, the PAGE/STATE pools the GPU memory left holds"
    )
    p.add_argument(
        "--model",
        help="checkpoint directory, a directory with only a config.json (counted from the declarations), or "
        "generated:<slice> (default: the embedded tiny model)",
    )
    p.add_argument("--dp", type=_positive_int, default=1, help="DP attention ranks the routed experts are split over")
    p.add_argument("--expert-mode", choices=("ep", "tp"), default="ep", help="routed experts: whole per rank, or each split")
    p.add_argument(
        "--gpu-memory",
        type=_byte_count,
        default=None,
        help="device memory of one rank (bytes, or with a unit: 141GB, 288GB, 139GiB); default: size the pools by "
        "the engine's cache_memory_bytes instead",
    )
    p.add_argument(
        "--gpu-memory-reserve",
        type=_byte_count,
        default=None,
        help="bytes kept back for activations, graphs and contexts (default: 10%% of --gpu-memory)",
    )
    p.add_argument("--block-size", type=_positive_int, default=None, help="PAGE tokens (default: the engine's)")
    p.add_argument(
        "--max-num-seqs", type=_positive_int, default=None, help="requests at once, one STATE slot each (default: the engine's)"
    )
    p.add_argument("--kv-cache-dtype", choices=("bf16", "fp4"), default=None, help="default: the engine's")
    p.add_argument("--index-cache-dtype", choices=("fp8", "fp4"), default=None, help="default: the engine's")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="bfloat16",
        help="compute dtype the plain weights take on the device (default bfloat16, a GPU's)",
    )
    p.add_argument(
        "--weight-storage",
        choices=WEIGHT_STORAGE,
        default=None,
        help="stored (the engine's default: FP8 / FP4 weights in the checkpoint's bytes) or decoded (the compute dtype)",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("validate", help="runtime validation: scheduled runs equal uninterrupted ones")
    p.add_argument(
        "--model", help="checkpoint directory or generated:<slice> (model/source.py; default: the embedded tiny model)"
    )
    p.add_argument("--output", required=True, help="JSON report path")
    p.add_argument("--dp", type=int, default=1, help="data-parallel attention ranks of the replica under test")
    p.add_argument("--expert-mode", choices=("ep", "tp"), default="ep", help="routed experts: whole per rank, or each split")
    p.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="local: the engine in this process (its DP ranks as threads); ray: an engine group per scenario",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: with ray, one GPU per rank")
    p.add_argument("--kernel-backend", choices=("torch", "triton"), default="torch", help="the ranks' kernels")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype of the replicas")
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run every replica in the batch-invariant mode (default; --no-batch-invariant measures the kernels' own "
        "batch dependence)",
    )
    p.add_argument(
        "--block-size", type=int, default=32, help="PAGE tokens (the workload scales with it; >= window - 1 for replay)"
    )
    p.add_argument("--scenarios", help="comma-separated scenario names (default: every one the replica supports)")
    _add_runtime_arguments(p)
    p.set_defaults(func=cmd_validate)

    from dsv41.deploy.bench import add_bench_arguments

    p = sub.add_parser("bench", help="serving benchmark: an OpenAI-compatible endpoint, or the engine in-process")
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve until Ctrl-C or SIGTERM")
    p.add_argument("--model", help="checkpoint directory (default: the config's, else the embedded tiny model)")
    p.add_argument(
        "--host",
        default=None,
        help=f"address the HTTP and gRPC listeners bind (default: the config's, else {DEFAULT_HOST}, this machine only; "
        "0.0.0.0 for every interface)",
    )
    p.add_argument("--port", type=int, default=None, help=f"HTTP port (default: the config's, else {DEFAULT_HTTP_PORT})")
    p.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help=f"gRPC port of dsv41.GenerateService (default: the config's grpc_port arg, else {DEFAULT_GRPC_PORT})",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes and as gRPC metadata (default: ${API_KEY_ENV}, "
        "else the config's api_key arg, else none)",
    )
    p.add_argument(
        "--auth-all-routes",
        action="store_true",
        help="with an API key, require it on /health and /metrics too (default: they stay open for probes)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="refuse larger request bodies with 413 (default: the config's limits, else 8 MiB)",
    )
    p.add_argument("--config", help="Serve YAML with one application of dsv41.deploy.app:build_app")
    _add_runtime_arguments(p)
    p.add_argument(
        "--start-timeout",
        type=_positive_number,
        default=DEFAULT_START_TIMEOUT_S,
        help=f"seconds to wait for every replica to run, then fail naming the ones that do not (default: {DEFAULT_START_TIMEOUT_S:g})",
    )
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from dsv41.cluster.options import EngineError
    from dsv41.model.config import ConfigError

    try:
        args.func(args)
    except ConfigError as exc:
        raise SystemExit(f"config error: {exc}") from exc
    except EngineError as exc:
        raise SystemExit(f"dsv41 {args.command}: {exc}") from exc


if __name__ == "__main__":
    main()
