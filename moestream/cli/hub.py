"""`moestream pull | list`: fetch a GGUF model from the Hugging Face Hub, show what the Hub cache holds.

`-m hf:REPO[:QUANT]` on any command that takes a model resolves through the same code (main() calls
resolve_hub_models before the command runs)."""

from __future__ import annotations

import argparse

from moestream.cli import values
from moestream.errors import HubError
from moestream.hub import EXAMPLE, PREFIX, HubModel, parse_spec
from moestream.units import fmt_bytes


def spec(text: str):
    try:
        return parse_spec(text)
    except ValueError as exc:
        raise values.Bad(str(exc)) from None


def cmd_pull(args: argparse.Namespace) -> int:
    from moestream.hub.pull import pull

    got = pull(args.spec)
    more = f" (+{len(got.files) - 1} parts)" if len(got.files) > 1 else ""
    print(f"{got.paths[0]}{more}")
    tag = got.tag or args.spec.quant
    print(f"{fmt_bytes(got.size)}; run it with: moestream run -m {PREFIX}{args.spec.repo}{':' + tag if tag else ''}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from huggingface_hub import constants

    from moestream.hub.cached import cached_models

    models = cached_models(constants.HF_HUB_CACHE)
    print(f"Hub cache: {constants.HF_HUB_CACHE}")
    if not models:
        print(f"no GGUF models cached; fetch one with: moestream pull {EXAMPLE}")
        return 0
    rows = [("MODEL (-m)", "SIZE", "FILES")]
    for m in models:
        files = m.files[0] + (f" (+{len(m.files) - 1} parts)" if len(m.files) > 1 else "")
        if len(m.files) != m.parts:
            files += f" (only {len(m.files)} of {m.parts} parts)"
        rows.append((f"{PREFIX}{m.repo}:{m.tag}" if m.tag else f"{PREFIX}{m.repo}", fmt_bytes(m.size), files))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]}")
    return 0


def resolve_hub_models(args: argparse.Namespace) -> None:
    """Every model option given as hf:REPO[:QUANT] becomes the path of its (fetched) first file."""
    for key, value in vars(args).items():
        if isinstance(value, HubModel):
            from moestream.hub.pull import pull

            try:
                setattr(args, key, pull(parse_spec(value)).paths[0])
            except ValueError as exc:
                raise HubError(str(exc)) from None


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    if command == "pull":
        p.add_argument(
            "spec",
            type=spec,
            metavar="REPO[:QUANT]",
            help=f"a Hub repository of GGUF files and the quant to fetch, e.g. {EXAMPLE} (default quant: Q4_K_M, "
            "else Q8_0, else the first model file, as llama.cpp's -hf picks); a split model's parts all come",
        )
        p.set_defaults(func=cmd_pull)
    else:
        p.set_defaults(func=cmd_list)
