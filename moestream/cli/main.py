"""`moestream` command line. Every user error ends as one line on stderr and a non-zero exit.

Each command lives in a module of moestream/cli/ with an `add_arguments(command, parser)`; only the
module of the command being run is imported (the HTTP stack, for one, stays out of `moestream run`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from moestream import __version__
from moestream.errors import MoestreamError
from moestream.hub import HubModel

EXIT_USER_ERROR = 2
MODEL_HELP = (
    "A model (-m) is a GGUF file; a split model (NAME-00001-of-0000N.gguf, llama.cpp's gguf-split) is given by "
    "any of its parts or the directory holding them, and `synth --split-max-size 2G` writes one. A model on the "
    "Hugging Face Hub is hf:OWNER/NAME[:QUANT] (fetched into its cache; `moestream pull` alone fetches it)."
)

COMMANDS = {  # name: (module, help)
    "run": ("moestream.cli.run", "generate text from a prompt"),
    "synth": ("moestream.cli.run", "write a synthetic model with random weights at a real shape"),
    "demo": ("moestream.cli.run", "run the main job on a built-in synthetic model bigger than its RAM budget"),
    "serve": ("moestream.cli.serve", "OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)"),
    "serve-ray": ("moestream.cli.serve_ray", "serve's endpoint with N engine replicas behind it, on Ray Serve"),
    "chat": ("moestream.cli.serve", "interactive chat in the terminal"),
    "probe": ("moestream.cli.analysis", "measure the disk: random reads of the model's expert size, cold"),
    "replay": ("moestream.cli.analysis", "replay a trace against cache policies and sizes"),
    "stats": ("moestream.cli.analysis", "workload statistics of a trace: U(k), reuse, coverage, hit rates"),
    "profile": ("moestream.cli.analysis", "rank (layer, expert) pairs by use, for pinning"),
    "forecast": ("moestream.cli.analysis", "predict decode tok/s from a disk probe, the model and a hit rate"),
    "routes": ("moestream.cli.routes", "import real routing as a route file; fit and draw from a routing model"),
    "pull": ("moestream.cli.hub", "fetch a GGUF model from the Hugging Face Hub: pull OWNER/NAME[:QUANT]"),
    "list": ("moestream.cli.hub", "list the GGUF models in the Hugging Face Hub cache"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors on one line (argparse prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, that command's arguments too (None: all of them)."""
    parser = ArgumentParser(prog="moestream", description=__doc__.split("\n")[0], epilog=MODEL_HELP)
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command", help="one of:")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or command == name:
            importlib.import_module(module).add_arguments(name, p)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, but an unknown option is the command's error, pointing at `moestream COMMAND --help` (argparse
    leaves what a command does not know to the top parser, whose message points at `moestream --help`)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else ""
    try:
        args = parse(build_parser(command), argv)
    except SystemExit as exc:  # --help, or a bad option (argparse printed it): a code for callers of main()
        return exc.code if isinstance(exc.code, int) else EXIT_USER_ERROR
    try:
        if any(isinstance(v, HubModel) for v in vars(args).values()):
            from moestream.cli.hub import resolve_hub_models

            resolve_hub_models(args)
        return args.func(args)
    except MoestreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a file the command writes or reads failed on the way (disk full, I/O error)
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where}; check the disk and the path", file=sys.stderr)
        return EXIT_USER_ERROR
    except MemoryError:
        print("error: out of memory; lower --ram-budget-mb or --ctx", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
