"""`jaxnn summary`: the per-layer table of a built-in model or preset, from shapes alone (no weights allocated),
so the largest presets cost nothing to inspect."""

from __future__ import annotations

import argparse
from typing import Any

from jaxnn.cli.config import parse_model_config
from jaxnn.cli.parsers import add_command


def add_summary_parser(sub: Any) -> None:
    p = add_command(
        sub,
        "summary",
        help="print a model's layers, output shapes and parameter counts without allocating its weights",
        description="The per-layer table of a built-in model (mlp, cnn, resnet, gpt, ...) or a preset (gpt2, "
        "llama-3-8b, resnet50, vit-b16, ...), and the published parameter count beside a preset's own.",
    )
    a = p.add_argument
    a("--model", default=None, help="a model family or a preset (see `jaxnn summary --list`)")
    a("--list", action="store_true", help="list the presets and exit")
    a("--model-config", nargs="+", default=[], metavar="FIELD=VALUE", help="set fields of the model's config")
    a("--batch-size", type=int, default=1)
    a("--seq-len", type=int, default=None, help="decoders: tokens per sequence (None: 128, at most the context)")
    a("--in-shape", default=None, metavar="H,W,C", help="image models: one image's shape (None: the preset's)")
    a("--depth", type=int, default=1, help="levels of nested layers to expand")
    a("--flops", action="store_true", help="also count FLOPs (compiles each layer: slow for large presets)")


def summary_main(args: argparse.Namespace) -> int:
    """Runs `jaxnn summary`; errors go to `jaxnn.cli.main`'s exit-status table."""
    from jaxnn.layers import summary
    from jaxnn.models.factory import build_model
    from jaxnn.models.presets import PRESETS

    if args.list:
        for name, p in PRESETS.items():
            print(f"{name:16s} {p.family:16s} {p.published_params or 0:>15,d}  {p.description}")
        return 0
    if args.model is None:
        raise ValueError("jaxnn summary: give --model NAME (a family or a preset), or --list")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    model, cfg = build_model(args.model, parse_model_config(args.model_config))
    in_shape = (args.batch_size, *_example_shape(args, cfg))
    table = summary(model, in_shape, depth=args.depth, flops=args.flops, print_fn=print)
    published = PRESETS[args.model].published_params if args.model in PRESETS else None
    if published is not None:
        same = "equal to" if table.total_params == published else "NOT equal to"
        print(f"{args.model}: {table.total_params:,d} parameters, {same} the published {published:,d}")
    return 0


def _example_shape(args: argparse.Namespace, cfg: Any) -> tuple[int, ...]:
    """One example's shape: token positions for a decoder, an image for the rest."""
    if hasattr(cfg, "vocab_size"):
        limit = cfg.seq_len if getattr(cfg, "position", "learned") == "learned" else None
        length = args.seq_len or (min(128, limit) if limit else 128)
        if limit is not None and length > limit:
            raise ValueError(f"--seq-len {length} exceeds the model's {limit} positions")
        return (length,)
    if args.in_shape:
        try:
            return tuple(int(d) for d in args.in_shape.split(","))
        except ValueError:
            raise ValueError(f"--in-shape must be integers separated by commas, got {args.in_shape!r}") from None
    if hasattr(cfg, "image_size"):
        return (cfg.image_size, cfg.image_size, 3)
    return (224, 224, 3) if getattr(cfg, "num_classes", 10) == 1000 else (28, 28, 1)
