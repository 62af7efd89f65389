"""The `tito` command.

    tito serve render|engine|derender [--address ADDR] [--model M] ...   one service
    tito serve engine --backend vllm --model DIR [-- VLLM_ENGINE_ARGS]    the engine on vLLM
    tito serve all [--model M] [--gateway-address ADDR] ...               the three (and the gateway), as processes
    tito serve all --smg-address HOST:PORT ...                            ... and SMG in front of the engine
    tito serve gateway [--address ADDR] [--engine-address A,B] ...        the OpenAI-compatible HTTP gateway
    tito chat "Hello"                                                     a chat through all three

`tito chat` without addresses starts `tito serve all` on private Unix sockets (on the trained demo
model `tito-demo` unless --model says otherwise; with that model and neither --image nor --tools it
attaches a generated red square), waits until the three services report SERVING, streams the answer as it
arrives (reasoning as a "thinking:" section, tool calls as "tool call: name(arguments)" lines),
and shuts them down again.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from tito.cpu_affinity import parse_cpu_list, run_on
from tito.config import ConfigError, ServerConfig
from tito.env_flags import apply_env, document_env
from tito.logs import LOG_LEVELS, setup_logging
from tito_models.paths import DEFAULT_CHAT_MODEL, DEFAULT_MODEL, resolve_model
from tito.serving import check_can_listen
from tito.settings import add_settings, declared
from tito.startup import StartupPhases
from tito.supervision import ChildProcess, Supervisor, stop_children

SERVICES = ("render", "engine", "derender")
#: The OpenAI-compatible HTTP gateway over the three (tito_gateway): `tito serve gateway`.
GATEWAY = "gateway"
#: SMG (PyPI smg) in front of the engine: `tito serve all --smg-address` (tito_cli.smg).
SMG = "smg"
DEFAULT_ADDRESSES = {"render": "127.0.0.1:50051", "engine": "127.0.0.1:50052", "derender": "127.0.0.1:50053",
                     GATEWAY: "127.0.0.1:8000"}


def _service_module(name: str):
    return importlib.import_module(f"tito_{name}.server")


def add_common_arguments(parser: argparse.ArgumentParser, service: str) -> None:
    """The flags every service shares (tito.config.ServerConfig and each config's --model, --device),
    generated from the service's config class; `add_arguments` of its server module adds the rest."""
    config_cls = _service_module(service).CONFIG
    add_settings(parser, config_cls, common=True, defaults={"address": DEFAULT_ADDRESSES[service]})
    if "device" not in {item.name for item in declared(config_cls)}:
        # One command line for all three (`tito serve all`, Kubernetes variables): only the engine
        # runs a model, so render and derender accept --device and have no use for it.
        parser.add_argument("--device", default="auto", help="the engine's; render and derender run on the CPU")


def build_parser(services: Iterable[str] = (*SERVICES, GATEWAY)) -> argparse.ArgumentParser:
    """The `tito` command line, with the flags of `services` (each imports its service's server
    module for them: `tito serve derender` builds only derender's, so it never loads the engine's
    torch or render's image stack)."""
    wanted = set(services)
    parser = argparse.ArgumentParser(prog="tito", description="token-in/token-out LLM serving over gRPC")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run a service")
    service_parsers = serve.add_subparsers(dest="service", required=True)
    for name in (*SERVICES, GATEWAY):
        sub = service_parsers.add_parser(name, help=f"run the {name} service" if name != GATEWAY else
                                         "run the OpenAI-compatible HTTP gateway over render, engine and derender")
        if name in wanted:
            add_common_arguments(sub, name)
            _service_module(name).add_arguments(sub)
            document_env(sub)
    everything = service_parsers.add_parser("all", help="run render, engine and derender as three processes (and "
                                                        "the HTTP gateway with --gateway-address)")
    _add_all_arguments(everything)
    document_env(everything)

    chat = commands.add_parser("chat", help="run one chat through render -> engine -> derender")
    chat.add_argument("text", help="the user message")
    chat.add_argument("--system", help="an optional system message")
    chat.add_argument("--image", action="append", default=[], metavar="PATH",
                      help="attach an image file to the user message (repeatable; needs a vision model); "
                           f"without it (and without --tools), the {DEFAULT_CHAT_MODEL} model started here gets a "
                           "generated red square")
    chat.add_argument("--no-image", action="store_true", help="send no image, not even the generated one")
    chat.add_argument("--tools", metavar="PATH",
                      help="offer the tools in this JSON file (a list of OpenAI-style tools, e.g. "
                           "docs/examples/weather_tool.json)")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int)
    chat.add_argument("--no-thinking", action="store_true", help="pass enable_thinking=false to the template")
    answer_format = chat.add_mutually_exclusive_group()
    answer_format.add_argument("--json-schema", metavar="FILE",
                               help="answer with JSON that validates against the JSON Schema in FILE "
                                    "(response_format json_schema)")
    answer_format.add_argument("--json", action="store_true",
                               help="answer with a JSON object (response_format json_object)")
    chat.add_argument("--render", help="render address; with --engine and --derender, use running services")
    chat.add_argument("--engine", help="engine address")
    chat.add_argument("--derender", help="derender address")
    chat.add_argument("--model", default=DEFAULT_CHAT_MODEL,
                      help="model for the services `tito chat` starts itself (default %(default)s)")
    chat.add_argument("--device", default="auto")
    chat.add_argument("--timeout", type=float, default=300.0, help="deadline of each call, seconds")
    chat.add_argument("--otel", action="store_true",
                      help="trace the chat with OpenTelemetry (docs/tracing.md; also on with OTEL_* variables); the "
                           "services `tito chat` starts trace too")
    security = chat.add_argument_group("reaching secured services (docs/security.md)")
    security.add_argument("--tls-ca-file", default="", help="PEM CA that issued the services' certificates (TLS on)")
    security.add_argument("--tls-cert-file", default="", help="client certificate, for mutual TLS")
    security.add_argument("--tls-key-file", default="", help="private key of --tls-cert-file")
    security.add_argument("--tls-server-name", default="",
                          help="name in the services' certificates, when it differs from the address's host")
    security.add_argument("--auth-token-file", default="", help="send `authorization: Bearer <token>` from the file")
    return parser


def serve_parser(parser: argparse.ArgumentParser, service: str) -> argparse.ArgumentParser:
    """The parser of `tito serve <service>` inside `parser` (from build_parser)."""
    serve = _subcommands(parser)["serve"]
    return _subcommands(serve)[service]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _add_all_arguments(parser: argparse.ArgumentParser) -> None:
    for name in SERVICES:
        parser.add_argument(f"--{name}-address", default=DEFAULT_ADDRESSES[name], help=f"{name} address")
    parser.add_argument("--gateway-address", default="",
                        help="also start the OpenAI-compatible HTTP gateway (tito serve gateway) here, host:port or "
                             "unix:/path, over the three (default: no gateway)")
    parser.add_argument("--smg-address", default="",
                        help="also start SMG (PyPI smg, the Rust gateway) here, host:port, in front of the engine, "
                             "which it drives over SMG's vllm.grpc.engine.VllmEngine: OpenAI chat and completions, "
                             "the Responses and Anthropic Messages APIs, its routing policies (needs a TCP "
                             "--engine-address; default: no SMG)")
    parser.add_argument("--smg-args", default="",
                        help="more flags for SMG, as one string after `=` (e.g. --smg-args='--prometheus-port 29001'); "
                             "they come last, so they win over the ones tito sets")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="given to the three services (default %(default)s)")
    parser.add_argument("--device", default="auto", help="the engine's (default %(default)s)")
    parser.add_argument("--log-level", default=ServerConfig.log_level, choices=LOG_LEVELS,
                        help="given to the three services (default %(default)s)")


def serve_one(args: argparse.Namespace) -> int:
    module = _service_module(args.service)
    setup_logging(args.log_level, args.service)
    phases = StartupPhases()
    try:
        with phases.phase("config"):
            config = module.config_from_args(args)
            config.validate()
    except ConfigError as exc:
        print(f"tito serve {args.service}: {exc}", file=sys.stderr)
        return 2
    if config.cpu_affinity:  # before any thread starts: they inherit it
        run_on(parse_cpu_list(config.cpu_affinity))
    try:
        asyncio.run(module.serve(config, phases))
    except ConfigError as exc:  # found while starting: a model that does not load, a port in use
        print(f"tito serve {args.service}: {exc}", file=sys.stderr)
        return 2
    return 0


def build_once(model: str) -> str:
    """Build a built-in model here, once, before the services start (not in three processes at once),
    and return the name given: each service finds the build in the cache and reports the model by
    that name (GetModelInfo, the gateway's /v1/models), never by the cache path it resolved to."""
    resolve_model(model)
    return model


def check_services(addresses: dict[str, str], model: str, device: str, log_level: str) -> dict[str, ServerConfig]:
    """What `tito serve all` checks before starting anything: each service's own command line
    (with the environment it will inherit) gives a valid config, and its TCP port is free; the
    configs by service. Raises ConfigError naming the service, so a mistake is one line rather than
    three failing processes."""
    parser = build_parser()
    configs = {}
    for name in SERVICES:
        argv = ["serve", name, "--address", addresses[name], "--model", model, "--device", device,
                "--log-level", log_level]
        args = parser.parse_args(argv)
        args.vllm_args = []
        try:
            apply_env(parser, serve_parser(parser, name), argv, args, os.environ)
            config = _service_module(name).config_from_args(args)
            config.validate()
            if config.health_address:
                raise ConfigError("TITO_HEALTH_ADDRESS would be the same for the three services: start them one "
                                  "by one (tito serve render|engine|derender) to give each its own")
            check_can_listen(addresses[name])
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        configs[name] = config
    return configs


def beside_engine_flags(engine_config) -> list[str]:
    """The flags that keep a process beside a native engine on CPU (render, derender, a router or
    gateway) off the engine core's CPUs: `--cpu-affinity` with the CPUs the core leaves, as the
    engine plans them from its model's work (tito_engine.model.cpu_runtime.plan_cpus); none when
    the core is not pinned (a real-size model computing on every CPU, CUDA, the vllm backend).
    Every process that wakes up per streamed token would otherwise preempt the step loop (measured:
    render -> engine -> derender at 0.68x of the engine alone with default placement, 1.03x with
    the services off the core's CPU)."""
    from tito.cpu_affinity import format_cpu_list
    from tito_engine.startup_plan import plan_startup

    plan = plan_startup(engine_config).cpus
    if plan is None or plan.core_cpus is None or not plan.server_cpus:
        return []
    return ["--cpu-affinity", format_cpu_list(plan.server_cpus)]


def service_commands(addresses: dict[str, str], model: str, device: str, log_level: str,
                     extra_args: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """The command line of each service for `spawn_all`; `extra_args` adds flags, by service name."""
    return {name: [sys.executable, "-m", "tito_cli", "serve", name, "--address", addresses[name],
                   "--model", model, "--device", device, "--log-level", log_level,
                   *(extra_args or {}).get(name, [])] for name in SERVICES}


def spawn_all(addresses: dict[str, str], model: str, device: str, log_level: str,
              extra_args: dict[str, list[str]] | None = None) -> list[subprocess.Popen]:
    """Start the three services as separate processes (each could run on its own machine);
    `extra_args` adds service-specific flags, by service name."""
    return [subprocess.Popen(command)
            for command in service_commands(addresses, model, device, log_level, extra_args).values()]


def gateway_argv(address: str, addresses: dict[str, str], log_level: str, extra: list[str] = ()) -> list[str]:
    """`tito serve gateway` on `address` over the three services at `addresses`."""
    return ["serve", GATEWAY, "--address", address, "--render-address", addresses["render"],
            "--engine-address", addresses["engine"], "--derender-address", addresses["derender"],
            "--log-level", log_level, *extra]


def check_gateway(address: str, addresses: dict[str, str], log_level: str) -> None:
    """The gateway's command line (with the environment) gives a valid config and its port is free."""
    parser = build_parser((GATEWAY,))
    argv = gateway_argv(address, addresses, log_level)
    args = parser.parse_args(argv)
    try:
        apply_env(parser, serve_parser(parser, GATEWAY), argv, args, os.environ)
        _service_module(GATEWAY).config_from_args(args).validate()
        check_can_listen(address)
    except ConfigError as exc:
        raise ConfigError(f"gateway: {exc}") from None


def gateway_command(address: str, addresses: dict[str, str], log_level: str, extra: list[str] = ()) -> list[str]:
    """The command line of the gateway `tito serve all --gateway-address` starts."""
    return [sys.executable, "-m", "tito_cli", *gateway_argv(address, addresses, log_level, extra)]


def stop_all(processes: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM each process, wait up to `timeout` seconds for all, then kill what is left."""
    stop_children([ChildProcess(f"tito {' '.join(map(str, p.args[3:5]))}", p) for p in processes], timeout,
                  kill_margin=0)


def smg_command_for(args: argparse.Namespace, executable: str, configs: dict[str, ServerConfig]) -> list[str]:
    """The command line of the SMG `tito serve all --smg-address` starts: the engine as its
    worker, parsing the engine's output with the parsers render would name for the model."""
    import shlex

    from tito_render.model import model_parsers

    from tito_cli.smg import parser_flags, smg_command

    engine = configs["engine"]
    if engine.tls_cert_file or engine.auth_token_file:
        raise ConfigError("--smg-address: the engine would serve TLS or require a token, which the SMG started here "
                          "is not given; run SMG yourself with its --client-cert-path / --api-key flags "
                          "(docs/deploy.md, \"tito behind SMG\")")
    try:
        extra = shlex.split(args.smg_args)
    except ValueError as exc:
        raise ConfigError(f"--smg-args {args.smg_args!r}: {exc}") from None
    return smg_command(executable, args.smg_address, args.engine_address, args.log_level,
                       configs["engine"].grace_seconds, parser_flags(*model_parsers(configs["render"])), extra)


def check_smg_flags(args: argparse.Namespace) -> str | None:
    """The `smg` command when --smg-address asks for SMG (checked first, before a model is built:
    ConfigError saying how to install SMG, or what address it needs); None without it."""
    if not args.smg_address:
        if args.smg_args:
            raise ConfigError("--smg-args needs --smg-address")
        return None
    from tito_cli.smg import check_smg

    return check_smg(args.smg_address, args.engine_address)


def _child_spawner(name: str, command: list[str]):
    """How the supervisor starts a child: SMG with its output prefixed, a tito service as it is
    (its log lines name their service already)."""
    if name == SMG:
        from tito_cli.smg import start_smg

        return lambda: ChildProcess(name, start_smg(command))
    return lambda: ChildProcess(name, subprocess.Popen(command))


def _serving_event(address: str) -> threading.Event:
    """An event set once the service at `address` reports SERVING (polled on a daemon thread; never
    set if it does not start, which the supervisor reports as that service's exit)."""
    from tito_client.pipeline import wait_until_serving

    serving = threading.Event()

    def wait() -> None:
        try:
            wait_until_serving(address, timeout=24 * 3600)
        except TimeoutError:
            return
        serving.set()

    threading.Thread(target=wait, name="engine health", daemon=True).start()
    return serving


def serve_all(args: argparse.Namespace) -> int:
    addresses = {name: getattr(args, f"{name}_address") for name in SERVICES}
    try:
        smg_executable = check_smg_flags(args)
        model = build_once(args.model)
        configs = check_services(addresses, model, args.device, args.log_level)
        if args.gateway_address:
            check_gateway(args.gateway_address, addresses, args.log_level)
        smg = smg_command_for(args, smg_executable, configs) if smg_executable else None
    except ConfigError as exc:
        print(f"tito serve all: {exc}", file=sys.stderr)
        return 2
    beside = beside_engine_flags(configs["engine"])
    commands = service_commands(addresses, model, args.device, args.log_level,
                                {"render": beside, "derender": beside})
    # One service ending ends them all (restart=False): each service restarts its own children, so
    # a service that exits has a reason its operator must see, not a replacement that hides it.
    supervisor = Supervisor(restart=False)
    if args.gateway_address:
        commands[GATEWAY] = gateway_command(args.gateway_address, addresses, args.log_level, beside)
    stopping = False

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        for name, command in commands.items():
            supervisor.start(name, _child_spawner(name, command))
        # SMG reads the engine's model facts once, when it registers the engine: started before the
        # engine is SERVING it would register a model named "unknown" without a tokenizer.
        engine_serving = _serving_event(addresses["engine"]) if smg is not None else None
        while not stopping:
            if engine_serving is not None and engine_serving.is_set():
                supervisor.start(SMG, _child_spawner(SMG, smg))
                engine_serving = None
            ended = supervisor.check()
            if ended is not None:
                print(f"tito serve all: {ended.name} exited with code {ended.exit_code}; stopping the others",
                      file=sys.stderr)
                return ended.exit_code or 1
            time.sleep(0.2)
        return 0
    finally:
        supervisor.stop(30.0, kill_margin=0)


def _chat_tools(path: str | None) -> list:
    """The --tools file as chat_pb2.Tool messages (ValueError with a readable message if it is not one)."""
    from google.protobuf import json_format

    from tito.v1 import chat_pb2

    if not path:
        return []
    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(tools, list):
            raise ValueError("expected a JSON list of tools")
        return [json_format.ParseDict(tool, chat_pb2.Tool()) for tool in tools]
    except (OSError, ValueError, json_format.ParseError) as exc:
        raise ValueError(f"--tools {path}: {exc}") from exc


def _generated_image() -> bytes:
    """The quick start's image: a red square, as PNG."""
    import io

    from tito_models.demo import colour_image

    buffer = io.BytesIO()
    colour_image("red", 96, 96).save(buffer, "PNG")
    return buffer.getvalue()


def _response_format(args: argparse.Namespace):
    """--json / --json-schema FILE as a render ResponseFormat (None: free text); ValueError with a
    readable message when the schema file is not a JSON object."""
    from tito.v1 import render_pb2

    if args.json_schema:
        try:
            schema = json.loads(Path(args.json_schema).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--json-schema {args.json_schema}: {exc}") from exc
        if not isinstance(schema, dict):
            raise ValueError(f"--json-schema {args.json_schema}: a JSON Schema is a JSON object")
        response_format = render_pb2.ResponseFormat(type="json_schema")
        response_format.json_schema.name = Path(args.json_schema).stem
        response_format.json_schema.schema.update(schema)
        return response_format
    return render_pb2.ResponseFormat(type="json_object") if args.json else None


def _chat_request(args: argparse.Namespace, images: list[bytes], tools: list, response_format=None):
    from google.protobuf import struct_pb2

    from tito.v1 import chat_pb2, render_pb2

    messages = []
    if args.system:
        messages.append(chat_pb2.ChatMessage(role="system", content=args.system))
    if images:
        parts = [chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=data)) for data in images]
        parts.append(chat_pb2.ContentPart(text=args.text))
        messages.append(chat_pb2.ChatMessage(role="user", content_parts=parts))
    else:
        messages.append(chat_pb2.ChatMessage(role="user", content=args.text))
    kwargs = struct_pb2.Struct()
    if args.no_thinking:
        kwargs.update({"enable_thinking": False})
    sampling = render_pb2.SamplingOptions(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        sampling.seed = args.seed
    return render_pb2.RenderChatRequest(messages=messages, tools=tools, sampling=sampling,
                                        chat_template_kwargs=kwargs, response_format=response_format)


def _chat_usage_error(args: argparse.Namespace, security) -> str:
    """Why the chat flags cannot work together ("" when they can)."""
    missing = [path for path in args.image if not Path(path).is_file()]
    if missing:
        return f"--image {missing[0]}: no such file"
    given = [args.render, args.engine, args.derender]
    if any(given) and not all(given):
        return "give all of --render, --engine and --derender, or none to start them"
    try:
        security.validate()
    except ConfigError as exc:
        return str(exc)
    if security != type(security)() and not all(given):
        return "TLS and token flags are for services started elsewhere (--render/--engine/--derender)"
    return ""


def chat(args: argparse.Namespace) -> int:
    from tito import tracing
    from tito_client.chat_output import ChatPrinter
    from tito_client.pipeline import ChatPipeline, Endpoints, wait_until_serving
    from tito.security import ClientSecurity

    security = ClientSecurity(ca_file=args.tls_ca_file, cert_file=args.tls_cert_file, key_file=args.tls_key_file,
                              server_name=args.tls_server_name, token_file=args.auth_token_file)
    problem = _chat_usage_error(args, security)
    try:
        tools = _chat_tools(args.tools)
        response_format = _response_format(args)
    except ValueError as exc:
        problem = problem or str(exc)
    if problem:
        print(f"tito chat: {problem}", file=sys.stderr)
        return 2
    images = [] if args.no_image else [Path(path).read_bytes() for path in args.image]
    processes: list[subprocess.Popen] = []
    tmp = None
    if args.render:
        endpoints = Endpoints(args.render, args.engine, args.derender)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="tito-")
        addresses = {name: f"unix:{Path(tmp.name) / (name + '.sock')}" for name in SERVICES}
        print(f"starting render, engine and derender on Unix sockets in {tmp.name} ...", file=sys.stderr)
        try:
            model = build_once(args.model)
        except ConfigError as exc:
            print(f"tito chat: {exc}", file=sys.stderr)
            return 2
        # The quick start's picture; a chat with tools is about the tools, so it gets none.
        if args.model == DEFAULT_CHAT_MODEL and not (args.image or args.no_image or tools):
            print("attaching a generated red square image (--image PATH for yours, --no-image for none)",
                  file=sys.stderr)
            images = [_generated_image()]
        processes = spawn_all(addresses, model, args.device, "warning",
                              {name: ["--otel"] for name in SERVICES} if args.otel else None)
        endpoints = Endpoints(**addresses)
    try:
        tracing.configure("chat", args.otel)
        for address in (endpoints.render, endpoints.engine, endpoints.derender):
            wait_until_serving(address, timeout=args.timeout, security=security)
        printer = ChatPrinter(sys.stdout, color=sys.stdout.isatty())
        with ChatPipeline(endpoints, timeout=args.timeout, security=security) as pipeline:
            for chunk in pipeline.stream_chat(_chat_request(args, images, tools, response_format)):
                printer.chunk(chunk)
        return 0
    except ConfigError as exc:  # tracing asked for but not installed
        print(f"tito chat: {exc}", file=sys.stderr)
        return 2
    finally:
        tracing.shutdown()  # export the chat's spans before exiting
        stop_all(processes)
        if tmp is not None:
            tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` is vLLM's (engine arguments passed through unchanged, vllm_args.py).
    passthrough: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, passthrough = argv[:split], argv[split + 1:]
    parser = build_parser(_services_asked_for(argv))
    args = parser.parse_args(argv)
    if passthrough and not (args.command == "serve" and args.service == "engine"):
        parser.error("arguments after `--` are vLLM engine arguments; only `tito serve engine --backend vllm` "
                     "takes them")
    args.vllm_args = passthrough
    if args.command == "serve":
        try:
            apply_env(parser, serve_parser(parser, args.service), argv, args, os.environ)
        except ConfigError as exc:
            print(f"tito serve {args.service}: {exc}", file=sys.stderr)
            return 2
        return serve_all(args) if args.service == "all" else serve_one(args)
    if args.command == "chat":
        return chat(args)
    return 2


def _services_asked_for(argv: list[str]) -> tuple[str, ...]:
    """The service whose flags `argv` needs (`tito serve engine ...`: the engine); none otherwise
    (`tito serve all` and `tito chat` check each service's flags themselves, in `check_services`)."""
    if len(argv) >= 2 and argv[0] == "serve" and argv[1] in (*SERVICES, GATEWAY):
        return (argv[1],)
    return ()


def run() -> None:
    """The `tito` program: `main()`, then exit without the interpreter's module teardown.

    With torch and grpc loaded that teardown alone takes a second or more, which a stopping pod
    would spend after its work is done. Exit handlers (atexit: logging, multiprocessing) still
    run; only the freeing of every module, which the OS does faster, is skipped."""
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
