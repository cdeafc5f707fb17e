"""`jaxnn train`'s flags: the parser `jaxnn.cli.train.config_from_args` reads a `TrainConfig` from, in groups (the
model, the optimizer, the run directory, several processes, the pipeline and outputs)."""

from __future__ import annotations

import argparse
from typing import Any

from jaxnn.cli.parsers import add_command
from jaxnn.cli.replay import remember_given


def add_train_parser(sub: Any) -> None:
    """The `train` subcommand and all its flags, on the `jaxnn` parser's subparsers `sub`."""
    p = add_command(
        sub,
        "train",
        help="train a model",
        description="Train a model; checkpoints, metrics.jsonl and plots go to the run directory.",
    )
    a = p.add_argument
    a(
        "--model",
        default=None,
        help="model: mlp, cnn, resnet, gpt, or a preset such as gpt2 or llama-3.2-1b (`jaxnn summary --list`); "
        "default cnn, or what --init-from's transformers folder holds",
    )
    a(
        "--data",
        default=None,
        metavar="DIR",
        help="directory of MNIST/Fashion-MNIST IDX, CIFAR-10 binary or text files, or a .jsonl file (or folder) of "
        '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]} records, the loss on completions '
        "(assistant turns) only (default: the bundled digits, or the Python stdlib source for gpt)",
    )
    a(
        "--chat-template",
        default=None,
        metavar="FILE",
        help='a Jinja chat template (or a JSON file holding chat_template) for {"messages": ...} records, where '
        "--init-from's folder has none (or to replace its own)",
    )
    a("--dataset", default="auto", help="data format: auto, digits, mnist, fashion_mnist, cifar10, text, synthetic")
    a("--size", default="base", help="model size: base (the model's default config) or small (for quick runs)")
    a("--steps", type=int, default=None, help="training steps (default per model)")
    a("--epochs", type=int, default=None, help="passes over the training set, instead of --steps")
    a("--accumulate", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
    a("--batch-size", type=int, default=None, help="global batch size, split over --devices (default per model)")
    a("--seed", type=int, default=0, help="seed for initialisation, shuffling and augmentation")
    add_optimizer_flags(p)
    add_model_flags(p)
    add_run_dir_flags(p)
    a(
        "--devices",
        type=int,
        default=1,
        help="data-parallel devices of this process (on a CPU, that many simulated devices)",
    )
    a(
        "--mesh",
        default=None,
        metavar="AXIS=SIZE,...",
        help="shard over a device mesh: data (batch), fsdp (batch and every large parameter and optimizer moment), "
        "tensor (attention heads and MLP width), e.g. data=2,fsdp=4; on a CPU, that many simulated devices",
    )
    a(
        "--sharding-rules",
        default=None,
        metavar="FILE",
        help='JSON table of parameter-name patterns -> partition specs, e.g. {"*dense.w": [null, "tensor"]} '
        "(default: the built-in models' rules; see docs/parallel.md)",
    )
    add_multiprocess_flags(p)
    add_pipeline_and_output_flags(p)
    a("--lr-find", action="store_true", help="run the learning-rate range test instead (plot in the run directory)")
    a("--config", default=None, metavar="FILE", help="replay a run's config.json; flags given beside it override it")
    remember_given(p)  # which flags were given, so that they override --config's values


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """`jaxnn train`'s flags for the model's shape and the images' augmentation."""
    a = p.add_argument
    a("--seq-len", type=int, default=None, help="gpt: context length in bytes")
    a("--d-model", type=int, default=None, help="gpt: model width (default 128)")
    a("--layers", type=int, default=None, help="gpt: number of transformer blocks")
    a(
        "--remat",
        default=None,
        metavar="POLICY",
        help="gpt: recompute each block's activations in the backward pass, keeping what POLICY says: nothing, "
        "dots, dots_no_batch, everything or offload (docs/performance.md, 'Rematerialisation')",
    )
    a(
        "--model-config",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="set fields of the model's config (values as JSON, else text), e.g. gpt's "
        "position=rope norm=rms num_kv_heads=2 scan_layers=true",
    )
    a("--crop-pad", type=int, default=0, help="images: random crop after zero-padding by this many pixels")
    a("--flip", action="store_true", help="images: random horizontal flips")
    a(
        "--augment",
        default="",
        metavar="OPS",
        help="images: random augmentation inside the train step, on the device, e.g. crop,flip,brightness=0.2,"
        "mixup (ops: crop[=pad] flip vflip brightness contrast saturation mixup cutmix; needs dm-pix)",
    )


def add_run_dir_flags(p: argparse.ArgumentParser) -> None:
    """`jaxnn train`'s flags for where the run lives, how often it checkpoints, and where it starts from."""
    a = p.add_argument
    a(
        "--run-dir",
        default=None,
        help="run directory (default runs/<model>-<data>/<time>; with --resume, the newest of those)",
    )
    a("--ckpt-dir", default=None, help="checkpoint directory (default <run-dir>/ckpt)")
    a("--resume", action="store_true", help="continue from the newest good checkpoint in the run directory")
    a("--overwrite", action="store_true", help="replace the run in --run-dir instead of refusing")
    a("--eval-every", type=int, default=0, help="evaluate every N steps (0: five times per run)")
    a("--log-every", type=int, default=50, help="log metrics and input wait every N steps")
    a("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: only at the end and on a signal)")
    a("--keep", type=int, default=3, help="checkpoints to keep")
    a("--keep-best", default=None, metavar="METRIC", help="keep the checkpoints best by this eval metric")
    a(
        "--keep-best-mode",
        default="auto",
        choices=("auto", "min", "max"),
        help="whether --keep-best's metric is best low or high (auto: from its name, e.g. accuracy high, loss low)",
    )
    a(
        "--init-from",
        default=None,
        metavar="PATH",
        help="start from another run's parameters and optimizer state, a transformers GPT-2/Llama folder (its "
        "tokenizer.json tokenises the text) or a torchvision ResNet .pth/.safetensors file",
    )
    a(
        "--adapters",
        default=None,
        metavar="DIR",
        help="with --init-from a transformers folder: LoRA adapters trained on it (a PEFT folder, or a jaxnn "
        "adapters .safetensors file) to train on, with their own settings",
    )
    a(
        "--pack",
        action="store_true",
        help="gpt on JSON Lines records: pack records into windows with segment ids (attention and positions "
        "restart per record, no loss across a boundary) instead of cutting the joined text; reports the packing "
        "efficiency",
    )
    a(
        "--lora",
        default="",
        metavar="SETTINGS",
        help="train LoRA adapters alone, the weights frozen: r=RANK,alpha=A,dropout=P,targets=PATTERN,PATTERN... "
        "(default targets: every attention and MLP weight; see docs/bring-a-checkpoint.md)",
    )
    a("--objective", choices=("dpo", "simpo"), default=None,
      help='preference tuning on {"prompt", "chosen", "rejected"} records: dpo (the reference: the base with the '
      "LoRA adapters off, or a frozen copy) or simpo (reference-free)")  # fmt: skip
    a("--beta", type=float, default=0.1, help="--objective's beta: the reward's scale (default 0.1)")


def add_optimizer_flags(p: argparse.ArgumentParser) -> None:
    """`jaxnn train`'s flags for the precision, the optimizer, its schedule and the loss."""
    a = p.add_argument
    a("--precision", default="fp32", help="precision policy: fp32, tf32, bf16, fp16, fp8 or fp8-delayed")
    a("--lr", type=float, default=None, help="peak learning rate of AdamW (default per model)")
    a("--warmup", type=int, default=None, help="linear warm-up steps before the cosine decay")
    a(
        "--schedule",
        default="cosine",
        choices=("cosine", "constant"),
        help="learning rate after the warm-up: cosine decay to 0 at the last step, or constant (a finished run "
        "can then be trained on with --resume and a larger --steps)",
    )
    a("--label-smoothing", type=float, default=0.0, help="classification: smooth the one-hot targets by this much")
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay on kernels")
    a("--clip-norm", type=float, default=1.0, help="clip the gradients' global norm to this (0: no clipping)")


def add_pipeline_and_output_flags(p: argparse.ArgumentParser) -> None:
    """`jaxnn train`'s flags for the host pipeline, what the run writes and prints, and its compilation cache."""
    a = p.add_argument
    a("--prefetch", type=int, default=2, help="batches put on the device ahead of the step (0: none)")
    a("--backend", default="grain", choices=("grain", "inline"), help="host pipeline: Grain workers or inline")
    a("--workers", type=int, default=0, help="Grain worker processes (0: reader threads in this process)")
    a(
        "--check-data",
        default="arrays",
        choices=("arrays", "all", "off"),
        help="refuse NaN/Inf inputs: in the data set's arrays at setup, also in every batch, or not at all",
    )
    a("--no-progress", action="store_true", help="no progress bar")
    a("--no-plots", action="store_true", help="no PNG plots at the end")
    a(
        "--metrics",
        nargs="+",
        default=[],
        choices=("csv", "tensorboard", "wandb", "mlflow"),
        help="metric writers besides metrics.jsonl: CSV files, TensorBoard event files (<run-dir>/tensorboard), "
        "a Weights & Biases run (WANDB_PROJECT, WANDB_MODE), an MLflow run (MLFLOW_TRACKING_URI, else "
        "<run-dir>/mlflow.db)",
    )
    a("--no-summary", action="store_true", help="do not print the model's per-layer table at the start")
    a("--profile-dir", default=None, metavar="DIR", help="write a jax.profiler trace of a few steps after warm-up")
    a(
        "--compile-cache",
        default="auto",
        metavar="DIR",
        help="directory of JAX's persistent compilation cache; auto: $JAXNN_COMPILE_CACHE, else ~/.cache/jaxnn/xla",
    )
    a("--no-compile-cache", action="store_true", help="compile every program afresh (no persistent cache)")


def add_multiprocess_flags(p: argparse.ArgumentParser) -> None:
    """`jaxnn train`'s flags for runs of several processes (one per host, or local ones on 127.0.0.1)."""
    a = p.add_argument
    a(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="multi-process run: address of process 0's coordination service (or JAXNN_COORDINATOR)",
    )
    a("--num-processes", type=int, default=None, help="multi-process run: number of processes (or JAXNN_NUM_PROCESSES)")
    a("--process-id", type=int, default=None, help="multi-process run: this process's index (or JAXNN_PROCESS_ID)")
    a("--cluster", action="store_true", help="multi-process run: let jax detect the processes (SLURM, Open MPI)")
    a(
        "--heartbeat-timeout",
        type=int,
        default=30,
        help="multi-process run: seconds after which a silent process counts as dead and the others stop",
    )
    a(
        "--step-timeout",
        type=float,
        default=300,
        help="multi-process run: stop if no step finishes in this many seconds (a peer died)",
    )
    a("--fail-at", type=int, nargs=2, metavar=("PROCESS", "STEP"), default=None, help=argparse.SUPPRESS)
