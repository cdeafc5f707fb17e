"""`jaxnn serve`: a trained GPT (a `jaxnn train` run, a transformers GPT-2/Llama folder, or a saved model) behind an
OpenAI-compatible HTTP API, decoding every request in one continuously batched engine (`jaxnn.serve`)."""

from __future__ import annotations

import argparse
import pathlib
import socket
import sys
from typing import Any, NamedTuple

from jaxnn.cli.parsers import add_command


class ServedModel(NamedTuple):
    model: Any
    params: Any
    model_state: Any
    precision: str
    context: int | None  # the longest sequence the model takes, where its source says
    tokenizer_folder: pathlib.Path | None  # where its tokenizer.json and chat template are; None: bytes


def add_serve_parser(sub: Any) -> None:
    p = add_command(
        sub,
        "serve",
        help="serve a trained GPT over an OpenAI-compatible HTTP API (completions, chat, streaming)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models and /health on 127.0.0.1 (by default). "
        "Requests join and leave one running decode batch at token granularity (continuous batching over --slots "
        "cache slots); greedy outputs equal `jaxnn generate`'s. Ctrl-C or SIGTERM finishes the requests in flight, "
        "then exits 0. Needs the serve extra (`pip install 'jaxnn[serve]'`).",
    )
    p.add_argument("model", help="a `jaxnn train` GPT run directory, a transformers GPT-2/Llama folder, or a "
                   "jaxnn.save_model folder")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback only by default)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one, printed at start)")
    p.add_argument("--name", default=None, help="the model's name in the API (default: the folder's name)")
    p.add_argument("--slots", type=int, default=16, help="requests decoded together (cache slots)")
    p.add_argument("--context", type=int, default=None, help="positions per request, prompt and completion "
                   "together (default: the model's sequence length)")  # fmt: skip
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before 503s")
    p.add_argument("--warm-up", type=int, default=None, metavar="TOKENS", help="compile the programs that prompts "
                   "of up to TOKENS tokens use before taking requests (else each new prompt width or batch of "
                   "joining requests waits for its compile)")  # fmt: skip
    p.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template (or a "
                   "tokenizer_config.json holding one) for a model whose folder has none")  # fmt: skip
    p.add_argument("--adapters", default=None, metavar="DIR", help="a PEFT LoRA adapter folder (adapter_config.json "
                   "and adapter_model.safetensors) for a transformers folder, merged into its weights")  # fmt: skip
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest)")
    p.add_argument("--compile-cache", default="auto", metavar="DIR", help="jax's persistent compilation cache: "
                   "'auto', 'off' or a directory")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def serve_main(args: argparse.Namespace) -> int:
    """Runs `jaxnn serve`; errors go to `jaxnn.cli.main`'s exit-status table."""
    from jaxnn._src.checks import positive_int
    from jaxnn._src.optional import require

    for flag in ("slots", "max_queue", "context", "warm_up"):
        if flag not in ("context", "warm_up") or getattr(args, flag) is not None:
            positive_int("jaxnn serve", f"--{flag.replace('_', '-')}", getattr(args, flag))
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    try:
        uvicorn = require("uvicorn", "jaxnn serve")
        require("starlette", "jaxnn serve")
    except ImportError as err:  # a missing extra is the user's to install: one line, exit status 2
        raise ValueError(str(err)) from None
    from jaxnn._src import compile_cache
    from jaxnn.serve.api import create_app

    listening = _listen(args.host, args.port)  # a port in use is refused before the model loads
    compile_cache.enable(args.compile_cache)
    served = _served(args)
    host, port = listening.getsockname()[:2]
    where = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    print(f"jaxnn serve: {served.name} on {where}/v1 ({args.slots} slots of {served.engine.context} positions)",
          file=sys.stderr, flush=True)  # fmt: skip
    config = uvicorn.Config(create_app(served), log_level=args.log_level, timeout_graceful_shutdown=None)
    _server(config).run(sockets=[listening])
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), or one ValueError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
        listening.listen(2048)  # clients that connect before uvicorn starts wait in the backlog
    except OSError as err:
        listening.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror or err})") from None
    return listening


def _served(args: argparse.Namespace) -> Any:
    from jaxnn.interop.tokenizer import first_end_id, special_token_ids
    from jaxnn.serve import Engine
    from jaxnn.serve.api import Served
    from jaxnn.serve.engine import every_width
    from jaxnn.serve.text import Codec

    loaded = load_served(args.model, args.step, args.adapters)
    context = args.context or loaded.context
    if context is None:
        raise ValueError(f"{args.model}: its sequence length is not recorded; pass --context N")
    if loaded.context is not None and context > loaded.context:
        raise ValueError(f"--context {context}: the model's learned positions stop at {loaded.context}")
    codec = Codec.from_folder(loaded.tokenizer_folder, args.chat_template)
    engine = Engine(loaded.model, loaded.params, context=context, model_state=loaded.model_state,
                    policy=loaded.precision, slots=args.slots, max_queue=args.max_queue)  # fmt: skip
    ids = special_token_ids(loaded.tokenizer_folder, engine.vocab) if loaded.tokenizer_folder else {}
    ends = ids.get("eos_token_id")
    end_ids = frozenset(ends if isinstance(ends, list) else [] if ends is None else [first_end_id(ids)])
    if codec.tokenizer is None and engine.vocab != 256:
        raise ValueError(f"{args.model}: {engine.vocab} token ids and no tokenizer.json; text is bytes only for 256")
    name = args.name or pathlib.Path(args.model).resolve().name
    if args.warm_up is not None:
        if args.warm_up >= context:
            raise ValueError(f"--warm-up {args.warm_up}: prompts must leave room in the context of {context}")
        engine.warm_up(every_width(args.warm_up))
    return Served(engine.start(), codec, name, end_ids)


def load_served(path: str, step: int | None, adapters: str | None = None) -> ServedModel:
    """The model, weights, context and tokenizer folder of a run, a transformers folder (with a PEFT adapter
    folder's adapters merged, where given) or a saved model."""
    from jaxnn.interop.hf import is_hf_folder
    from jaxnn.saving import is_saved_model

    if is_hf_folder(path):
        return _hf(pathlib.Path(path), adapters)
    if adapters is not None:
        raise ValueError(f"--adapters: {path} is not a transformers folder; a LoRA run's adapters are in the run")
    if is_saved_model(path):
        from jaxnn.saving import load_model

        model, params, state = load_model(path)
        folder = pathlib.Path(path) / "tokenizer"
        return ServedModel(model, params, state, "fp32", None, folder if folder.is_dir() else None)
    return _run(path, step)


def _hf(folder: pathlib.Path, adapters: str | None) -> ServedModel:
    import jax

    from jaxnn.interop.hf import load_hf
    from jaxnn.models import GPT

    cfg, params = load_hf(folder)
    if adapters is not None:
        from jaxnn.interop.peft import load_peft
        from jaxnn.lora import merge

        params = merge(load_peft(adapters, cfg, params)[0])
    has_tokenizer = (folder / "tokenizer.json").is_file()
    return ServedModel(GPT(cfg), jax.tree.map(jax.numpy.asarray, params), None, "fp32", cfg.seq_len,
                       folder if has_tokenizer else None)  # fmt: skip


def _run(path: str, step: int | None) -> ServedModel:
    from jaxnn.checkpoint import load_params
    from jaxnn.interop.tokenizer import run_tokenizer_folder
    from jaxnn.lora import merge
    from jaxnn.models.factory import model_from_record

    loaded = load_params(path, step=step)
    if loaded.config.get("model") != "gpt":
        what = f"a {loaded.config['model']!r} run" if loaded.config.get("model") else "not a run of `jaxnn train`"
        raise ValueError(f"{path}: {what}; serve needs a GPT run, a transformers folder or a saved GPT")
    model, mcfg = model_from_record(loaded.config)
    folder = run_tokenizer_folder(loaded.config, loaded.directory)
    precision = loaded.config.get("precision", "fp32")
    return ServedModel(model, merge(loaded.params), loaded.model_state, precision, mcfg.seq_len, folder)


def _server(config: Any) -> Any:
    """uvicorn's server, exiting normally after a SIGTERM or Ctrl-C: uvicorn drains the requests in flight, then
    re-raises the signal, which would end the process with 128+N; a server asked to stop has done its work."""
    import contextlib

    import uvicorn

    class DrainingServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()  # drained: nothing left to re-raise

    return DrainingServer(config)
