"""`moestream routes import | fit | gen`: route files (analysis/route_files.py) from real routing, and from a
routing model fitted to it (analysis/route_model.py), for `--route-trace` and `moestream replay`."""

from __future__ import annotations

import argparse
import sys

from moestream.analysis import route_model as rm
from moestream.analysis.forecast import geometry_from_gguf
from moestream.analysis.route_files import check_shape, read_routes, shape_text, write_routes
from moestream.cli import values
from moestream.errors import MoestreamError
from moestream.synth.shapes import SHAPES


def cmd_import(args: argparse.Namespace) -> int:
    rs = read_routes(args.source, args.experts)
    if args.model:
        g = geometry_from_gguf(args.model)
        check_shape(rs, args.source, g.n_layers, g.n_experts, g.top_k, g.model)
        rs.n_experts, rs.experts_known = g.n_experts, True
        rs.expert_bytes = rs.expert_bytes or g.expert_bytes
    n = write_routes(rs, args.output)
    print(
        f"{args.output}: {len(rs.samples)} samples, {rs.decode_tokens} decode tokens, {rs.shape} ({n} rows)",
        file=sys.stderr,
    )
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    rs = read_routes(args.source, args.experts)
    model = rm.fit(rs)
    rm.save_model(model, args.output)
    print(
        f"{args.output}: fitted on {len(rs.samples)} samples, {rs.decode_tokens} tokens of {rs.shape}; "
        f"reuse between consecutive tokens {model['reuse']:.2f}",
        file=sys.stderr,
    )
    return 0


def _gen_shape(args: argparse.Namespace, model: dict) -> tuple[int, int, int]:
    layers, experts, top_k = int(model["layers"]), int(model["experts"]), int(model["top_k"])
    if args.shape:
        if args.shape not in SHAPES:
            raise MoestreamError(f"unknown shape {args.shape!r}; choose one of: {', '.join(SHAPES)}")
        s = SHAPES[args.shape]
        layers, experts, top_k = s.n_layers - getattr(s, "n_dense", 0), s.n_experts, s.top_k
    layers, experts, top_k = args.layers or layers, args.experts or experts, args.top_k or top_k
    if top_k > experts:
        raise MoestreamError(f"top-{top_k} needs at least {top_k} experts, the shape has {experts}")
    return layers, experts, top_k


def cmd_gen(args: argparse.Namespace) -> int:
    model = rm.load_model(args.model)
    layers, experts, top_k = _gen_shape(args, model)
    rs = rm.generate(model, [args.tokens] * args.samples, layers, experts, top_k, seed=args.seed)
    n = write_routes(rs, args.output)
    print(
        f"{args.output}: {args.samples} samples of {args.tokens} tokens, {shape_text(layers, experts, top_k)} "
        f"({n} rows)",
        file=sys.stderr,
    )
    return 0


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="routes_command", required=True, metavar="action", help="one of:")
    imp = sub.add_parser("import", help="read real routing into a route file (--route-trace, replay)")
    imp.add_argument(
        "source",
        type=values.input_file,
        help="per-sample arrays (.npz [tokens, layers, top_k] each, a .json beside it ordering them), a "
        "'route_trace v1' CSV, or a moestream --trace CSV",
    )
    imp.add_argument("-o", "--output", required=True, type=values.output_file, help="the route file to write")
    imp.add_argument(
        "--model", type=values.model_path, help="check the routes against this model's shape (and take its sizes)"
    )
    imp.add_argument("--experts", type=values.positive, help="experts per layer, where the source does not say")
    imp.set_defaults(func=cmd_import)
    fit = sub.add_parser("fit", help="fit a routing model (JSON) to real routing")
    fit.add_argument("source", type=values.input_file, help="any source `routes import` reads, or a route file")
    fit.add_argument("-o", "--output", required=True, type=values.output_file, help="the model's JSON file")
    fit.add_argument("--experts", type=values.positive, help="experts per layer, where the source does not say")
    fit.set_defaults(func=cmd_fit)
    gen = sub.add_parser("gen", help="draw a route file from a routing model")
    gen.add_argument("model", type=values.input_file, help="a routing model from `routes fit`")
    gen.add_argument("--shape", help=f"a synth shape to draw for (default the model's): {', '.join(SHAPES)}")
    gen.add_argument("--layers", type=values.positive, help="MoE layers (overrides the shape's)")
    gen.add_argument("--experts", type=values.positive, help="experts per layer (overrides the shape's)")
    gen.add_argument("--top-k", type=values.positive, help="experts per token (overrides the shape's)")
    gen.add_argument("--tokens", type=values.positive, default=256, help="decode tokens per sample (default 256)")
    gen.add_argument("--samples", type=values.positive, default=1, help="samples, one request each (default 1)")
    gen.add_argument("--seed", type=values.seed, default=0, help="seed of the draw (default 0)")
    gen.add_argument("-o", "--output", required=True, type=values.output_file, help="the route file to write")
    gen.set_defaults(func=cmd_gen)
