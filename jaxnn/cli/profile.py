"""`jaxnn profile`: the per-layer roofline of a built-in model (`jaxnn.profile`) for one or more precisions, printed
and written to `--out` as profile.json, roofline.png and layer_time.png."""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
from typing import Any

from jaxnn._src.model_names import MODELS
from jaxnn._src.storage import check_writable
from jaxnn.cli.config import parse_model_config
from jaxnn.cli.parsers import add_command
from jaxnn.errors import ConfigError

# One example's shape when --in-shape is not given: what `jaxnn train --model M` trains on by default (the bundled
# 8x8 digits), so the profile is of the step a user runs; a model whose config fixes its image size (a ViT) takes
# that size, and the GPT takes --seq-len token ids.
IMAGE_SHAPE = (8, 8, 1)


def add_profile_parser(sub: Any) -> None:
    p = add_command(
        sub,
        "profile",
        help="time each layer of a model against this machine's measured roofline",
        description="Per top-level layer: forward and forward+backward time, XLA's FLOPs and bytes, intensity, "
        "fraction of the measured matmul peak and copy bandwidth, the bound, and a projected accelerator's lower "
        "bound. Writes profile.json, roofline.png and layer_time.png to --out.",
    )
    a = p.add_argument
    a("--model", default="cnn", help=f"model: {', '.join(MODELS)}, or a preset (`jaxnn summary --list`)")
    a("--size", default="base", choices=("base", "small"), help="model size, as for `jaxnn train`")
    a("--batch-size", type=int, default=None, help="batch size (None: the model's `jaxnn train` default)")
    a(
        "--in-shape",
        default=None,
        metavar="H,W,C",
        help="one image's shape (None: 8,8,1, the digits `jaxnn train` trains on by default)",
    )
    a("--seq-len", type=int, default=None, help="gpt: tokens per sequence (None: its `jaxnn train` default)")
    a("--model-config", nargs="+", default=[], metavar="FIELD=VALUE", help="set fields of the model's config")
    a("--precision", nargs="+", default=["fp32", "bf16"], help="precision policies to profile")
    a("--repeats", type=int, default=5, help="timing windows per program (the median is reported)")
    a("--matmul-size", type=int, default=2048, metavar="N", help="the peak's N x N x N product")
    a("--copy-mib", type=int, default=256, metavar="MIB", help="the bandwidth's elementwise pass over this many MiB")
    a("--out", default=None, metavar="DIR", help="output directory (None: runs/profile-<model>/<time>)")
    a("--accelerator", default="H200", help="name of the projected accelerator")
    a(
        "--peak-bf16",
        type=float,
        default=None,
        metavar="TFLOPS",
        help="its bf16 peak (None: 790, the figure given for an H200)",
    )
    a("--peak-fp32", type=float, default=None, metavar="TFLOPS", help="its fp32 peak (None: 67, the H200 spec sheet)")
    a("--bandwidth", type=float, default=None, metavar="TB/S", help="its memory bandwidth (None: 4.3)")
    a("--no-plots", action="store_true", help="write no PNG plots")


def _in_shape(args: argparse.Namespace, mcfg: Any) -> tuple[int, ...]:
    if hasattr(mcfg, "vocab_size"):  # a decoder: token ids
        return (mcfg.seq_len,)
    if args.in_shape is None:
        size = getattr(mcfg, "image_size", None)
        return (size, size, 3) if size else IMAGE_SHAPE
    try:
        shape = tuple(int(d) for d in args.in_shape.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise ConfigError(f"--in-shape must be positive integers separated by commas, got {args.in_shape!r}")
    return shape


def build_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The built-in model `jaxnn train` would build for these flags, and its config."""
    from jaxnn.models.factory import family, train_default_model

    fields = {"seq_len": args.seq_len} if family(args.model) == "gpt" and args.seq_len else {}
    return train_default_model(args.model, {**fields, **parse_model_config(args.model_config)}, size=args.size)


def _checked(args: argparse.Namespace) -> tuple[Any, Any, tuple[int, ...], int, Any]:
    """Everything that can be refused, refused before any measurement or write."""
    from jaxnn.precision import get_policy
    from jaxnn.profile.projection import accelerator

    model, mcfg = build_model(args)
    shape = _in_shape(args, mcfg)
    from jaxnn.models.factory import MODEL_DEFAULTS, family

    defaults = MODEL_DEFAULTS.get(family(args.model), {"batch_size": 1})
    batch = args.batch_size if args.batch_size is not None else defaults["batch_size"]
    positive = (("--batch-size", batch), ("--repeats", args.repeats), ("--matmul-size", args.matmul_size))
    for what, value in (*positive, ("--copy-mib", args.copy_mib)):
        if value <= 0:
            raise ConfigError(f"{what} must be a positive integer, got {value}")
    for name in args.precision:
        get_policy(name)
    accel = accelerator(
        args.accelerator, bf16_tflops=args.peak_bf16, fp32_tflops=args.peak_fp32, bandwidth_tbs=args.bandwidth
    )
    return model, mcfg, shape, batch, accel


def profile_main(args: argparse.Namespace) -> int:
    """Runs `jaxnn profile`; errors go to `jaxnn.cli.main`'s exit-status table."""
    model, mcfg, shape, batch, accel = _checked(args)  # a ConfigError or ProjectionError before any measurement
    if args.out:
        check_writable(args.out)  # a bad --out is refused now, not after minutes of measurement
    from jaxnn.precision import get_policy
    from jaxnn.profile import measure_peaks, profile_layers

    dtypes = [get_policy(p).compute_dtype for p in args.precision]
    peaks = measure_peaks(dtypes, matmul_size=args.matmul_size, copy_mib=args.copy_mib, repeats=args.repeats)
    id_range = getattr(mcfg, "vocab_size", 2)
    profiles = [
        profile_layers(
            model,
            shape,
            batch_size=batch,
            policy=p,
            peaks=peaks,
            accelerator=accel,
            repeats=args.repeats,
            id_range=id_range,
            print_fn=print,
        )
        for p in args.precision
    ]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = pathlib.Path(args.out or f"runs/profile-{args.model}/{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps([p.as_dict() for p in profiles], indent=1) + "\n")
    written = [out / "profile.json"]
    if not args.no_plots:
        from jaxnn.profile.plots import write_profile_plots

        try:
            written += write_profile_plots(profiles, out)
        except ImportError as err:
            print(f"jaxnn: no plots: {err}", file=sys.stderr)
    print(f"jaxnn: wrote {', '.join(str(p) for p in written)}")
    return 0
