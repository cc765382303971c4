"""``pagedserve``: generate, serve and bench from the command line.

User mistakes (a missing device, a bad flag, an unreadable model) end in one line on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from pagedserve.engine_args import add_engine_args, config_from_args


def _generate(args: argparse.Namespace) -> None:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.errors import ConfigError
    from pagedserve.sampling_params import SamplingParams

    llm = LLM.from_config(config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed)
    if args.chat:
        if llm.get_tokenizer().chat_template is None:
            raise ConfigError(f"--chat: the model {llm.engine.model_name} has no chat template; "
                              "give one with --chat-template, or leave --chat out to complete the "
                              "prompt as text")
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)


def _serve(args: argparse.Namespace) -> None:
    from pagedserve.server.app import run_server

    run_server(args)


def _bench(args: argparse.Namespace) -> None:
    import importlib

    importlib.import_module(f"pagedserve.bench.{args.bench_name.replace('-', '_')}").main(args)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a mistake is one line, as the module docstring promises:
    argparse prints the command's whole usage (some fifty lines for serve) before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedserve")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    # `pagedserve serve MODEL`, as `vllm serve MODEL`; --model (an engine flag) says the same,
    # and repeated (`--model A --model B`) serves several models.
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="the model, as --model takes it (give one or the other)")
    from pagedserve.server.args import add_server_args

    add_server_args(serve)
    add_engine_args(serve, models_dest="models")
    serve.set_defaults(func=_serve, models=[])

    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = bench.add_subparsers(dest="bench_name", required=True)
    from pagedserve.bench import register_bench_commands

    register_bench_commands(bench_sub)
    bench.set_defaults(func=_bench)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with serve's positional MODEL moved into ``model`` (and
    ``models``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None:
            parser.error(f"serve: the model was given twice ({tag} and --model {args.model}); "
                         "pass it once, either way")
        args.model, args.models = tag, [tag]
    return args


# The sampling parameters generate names otherwise than as --PARAM (--seed is the engine's).
_GENERATE_FLAGS = {"prompt": "the prompt", "seed": "--sampling-seed"}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from pagedserve.errors import ConfigError
    from pagedserve.models.config import UnsupportedModel
    from pagedserve.models.loader import ModelLoadError
    from pagedserve.platforms.interface import PlatformUnavailable
    from pagedserve.quant.formats import QuantConfigError
    from pagedserve.sampling_params import InvalidSamplingParam

    try:
        args.func(args)
    except (ConfigError, UnsupportedModel, ModelLoadError, PlatformUnavailable,
            QuantConfigError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except InvalidSamplingParam as exc:  # generate's prompt or sampling flags
        flag = _GENERATE_FLAGS.get(exc.param) or "--" + exc.param.replace("_", "-")
        print(f"pagedserve: error: {flag}: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
