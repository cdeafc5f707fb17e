"""`jaxnn predict` and `jaxnn evaluate`: a trained model (a `jaxnn.save_model` folder, or a `jaxnn train` run)
applied to new inputs or scored on a data set, without writing any Python."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any, NamedTuple

from jaxnn.cli.parsers import add_command

MODEL_HELP = "a jaxnn.save_model folder, or a run directory of `jaxnn train` (or its ckpt/ or a step folder)"


class TrainedModel(NamedTuple):
    """What the commands need of a trained model, whichever form it was kept in."""

    model: Any
    params: Any
    model_state: Any
    precision: str
    input: dict | None  # one example's {"shape", "dtype"}, where the source records it
    config: dict  # the run config of a `jaxnn train` run; {} for a saved model
    directory: pathlib.Path  # the saved model folder, or the run's checkpoint directory


def load_trained(path: str, step: int | None = None) -> TrainedModel:
    """The model, weights and facts of a saved model folder or a `jaxnn train` run (its newest or `step`'s
    checkpoint); anything else is one ValueError naming the path."""
    from jaxnn.saving import is_saved_model, load_model, saved_record

    if is_saved_model(path):
        if step is not None:
            raise ValueError(f"--step {step}: {path} is a saved model, which holds one state; drop --step")
        model, params, model_state = load_model(path)
        spec = saved_record(path).get("input")
        return TrainedModel(model, params, model_state, "fp32", spec, {}, pathlib.Path(path))
    from jaxnn.checkpoint import load_params
    from jaxnn.export import example_input
    from jaxnn.lora import merge
    from jaxnn.models.factory import model_from_record

    loaded = load_params(path, step=step)
    if "model" not in loaded.config:
        raise ValueError(
            f"{path}: a run of jaxnn.fit with a model of its own, which its checkpoint does not describe; save it "
            "with jaxnn.save_model to use it here"
        )
    model, _ = model_from_record(loaded.config)
    shape, dtype = example_input(loaded.config, path)
    spec = _run_summary(loaded.directory).get("input") or {"shape": list(shape), "dtype": dtype}
    precision = loaded.config.get("precision", "fp32")
    params = merge(loaded.params)
    return TrainedModel(model, params, loaded.model_state, precision, spec, loaded.config, loaded.directory)


def _run_summary(checkpoint_dir: pathlib.Path) -> dict:
    """The summary.json of the run a checkpoint directory belongs to, or {}."""
    for folder in (checkpoint_dir.parent, checkpoint_dir.parent.parent):
        try:
            return json.loads((folder / "summary.json").read_text())
        except (OSError, ValueError):
            continue
    return {}


def as_model_input(x: Any, trained: TrainedModel, source: str) -> Any:
    """`x` as the model takes it: stored images (integers) normalised as the training pipeline did, where the
    model's record says how; float inputs as given (taken to be normalised already)."""
    import numpy as np

    check_inputs(x, trained, source)
    how = (trained.input or {}).get("normalise")
    if how is None or np.issubdtype(x.dtype, np.floating):
        return x
    from jaxnn.data.preprocess import normalise

    print(f"jaxnn: {source}: {x.dtype} images normalised as in training ((x / {how['scale']:g} - mean) / std)",
          file=sys.stderr)  # fmt: skip
    return normalise(x, how["scale"], how["mean"], how["std"])


def add_predict_parser(sub: Any) -> None:
    p = add_command(
        sub,
        "predict",
        help="write a trained model's outputs for the inputs in a .npy/.npz file",
        description="Run a trained model (eval mode) on every example of an array file and write its outputs "
        "(or, with --classes, the index of the largest output) as a .npy file.",
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--input", required=True, metavar="FILE", help=".npy array, or .npz holding 'x' (or one array)")
    p.add_argument("--out", required=True, metavar="FILE", help=".npy file to write (an existing one is refused)")
    p.add_argument("--classes", action="store_true", help="write the index of each row's largest output")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def add_evaluate_parser(sub: Any) -> None:
    p = add_command(
        sub,
        "evaluate",
        help="print a trained model's loss and accuracy on a data set's test split or an array file",
        description="Score a trained model on every example once: a data set's test split (a run's own by "
        "default) or the 'x' and 'y' arrays of a .npz file. Prints one JSON line of metrics.",
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--dataset", default=None, help="data set name (default: the run's; for a saved model, digits "
                   "or what --data holds)")  # fmt: skip
    p.add_argument("--data", default=None, metavar="DIR", help="data directory (mnist, cifar10, text files)")
    p.add_argument("--arrays", default=None, metavar="FILE", help=".npz file with 'x' and 'y' (instead of a data set)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the metrics to this JSON file")
    p.add_argument("--metrics", nargs="+", default=None, metavar="NAME", help="metrics computed over the whole data "
                   "set besides the loss's: accuracy, f1, precision, recall (and _micro), roc_auc, top5_accuracy, "
                   "confusion_matrix, perplexity, mae, mse")  # fmt: skip


def read_array_file(path: str, names: tuple[str, ...] = ("x",)) -> list[Any]:
    """The arrays `names` of a .npz file (a .npy or a one-array .npz for a lone "x"); one ValueError otherwise."""
    import numpy as np

    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        loaded = np.load(file, allow_pickle=False)
    except Exception as err:  # noqa: BLE001 - numpy raises several kinds for a file that is not an array
        raise ValueError(f"{path}: not a .npy or .npz array file ({type(err).__name__}: {err})") from None
    if isinstance(loaded, np.ndarray):
        if names != ("x",):
            raise ValueError(f"{path}: one array; this needs a .npz file with {', '.join(names)}")
        return [loaded]
    with loaded:
        if names == ("x",) and "x" not in loaded.files and len(loaded.files) == 1:
            return [loaded[loaded.files[0]]]
        missing = [n for n in names if n not in loaded.files]
        if missing:
            raise ValueError(f"{path}: has no array {', '.join(missing)} (it holds {', '.join(loaded.files)})")
        return [loaded[n] for n in names]


def check_inputs(x: Any, trained: TrainedModel, source: str) -> None:
    """Refuses inputs whose example shape is not the model's (where the source records it), naming both."""
    spec = trained.input
    if spec is None or tuple(x.shape[1:]) == tuple(spec["shape"]):
        return
    raise ValueError(
        f"{source}: examples of shape {tuple(x.shape[1:])} (array {tuple(x.shape)}), but the model takes "
        f"{tuple(spec['shape'])} per example (batch first)"
    )


def predict_main(args: argparse.Namespace) -> int:
    """Runs `jaxnn predict`; errors go to `jaxnn.cli.main`'s exit-status table."""
    import numpy as np

    from jaxnn._src.storage import check_writable, write_bytes_atomic

    out = pathlib.Path(args.out)
    if out.suffix != ".npy":
        raise ValueError(f"--out {args.out}: predictions are written as a .npy file; name it *.npy")
    if out.exists() and not args.overwrite:
        raise ValueError(f"--out {args.out} exists; pass --overwrite to replace it")
    check_writable(out.parent if str(out.parent) else ".")
    (x,) = read_array_file(args.input)
    trained = load_trained(args.model, args.step)
    x = as_model_input(x, trained, args.input)
    import jaxnn

    outputs = jaxnn.predict(trained.model, trained.params, x, model_state=trained.model_state,
                            batch_size=args.batch_size, precision=trained.precision)  # fmt: skip
    result = np.argmax(outputs, axis=-1) if args.classes else np.asarray(outputs)
    buffer = _npy_bytes(result)
    write_bytes_atomic(out, buffer)
    print(f"jaxnn: wrote {'classes' if args.classes else 'outputs'} {result.shape} {result.dtype} -> {out}")
    return 0


def _npy_bytes(array: Any) -> bytes:
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def evaluate_main(args: argparse.Namespace) -> int:
    """Runs `jaxnn evaluate`; errors go to `jaxnn.cli.main`'s exit-status table."""
    import jaxnn

    if args.arrays and (args.data or args.dataset):
        raise ValueError("--arrays and --data/--dataset exclude each other")
    trained = load_trained(args.model, args.step)
    data, loss, seq_len = _evaluation_data(args, trained)
    metrics = jaxnn.evaluate(trained.model, trained.params, data, loss=loss, model_state=trained.model_state,
                             batch_size=args.batch_size, precision=trained.precision, seq_len=seq_len,
                             metrics=args.metrics)  # fmt: skip
    line = json.dumps({k: v if isinstance(v, list) else round(float(v), 6) for k, v in metrics.items()})
    if args.out:
        from jaxnn._src.storage import write_bytes_atomic

        write_bytes_atomic(pathlib.Path(args.out), (line + "\n").encode())
    print(line)
    return 0


def _evaluation_data(args: argparse.Namespace, trained: TrainedModel) -> tuple[Any, Any, int]:
    """(data, loss, seq_len): the array file's, or the named (or the run's own) data set's test split, with the
    loss its kind of data takes (next-token for text, classification for images)."""
    from jaxnn.data import ImageDataset, detect_format, load_dataset
    from jaxnn.train import masked_classification_loss

    shape = (trained.input or {}).get("shape") or [128]
    if args.arrays:
        x, y = read_array_file(args.arrays, ("x", "y"))
        x = as_model_input(x, trained, args.arrays)
        return (x, y), masked_classification_loss, int(shape[0])
    data_dir = args.data if args.data is not None else trained.config.get("data_dir")
    name = args.dataset or (trained.config.get("dataset") if args.data is None else None)
    if name in (None, "auto"):
        gpt = trained.config.get("model") == "gpt"
        name = detect_format(data_dir) if data_dir else ("text" if gpt else "digits")
    if name == "text":
        return _text(trained, data_dir), _lm_loss(), int(shape[0])
    data = load_dataset(name, data_dir)
    assert isinstance(data, ImageDataset)  # every name but "text" is an image data set
    if trained.input is not None and tuple(data.image_shape) != tuple(trained.input["shape"]):
        raise ValueError(
            f"data set {name}: images of shape {tuple(data.image_shape)}, but the model takes "
            f"{tuple(trained.input['shape'])}"
        )
    return data, masked_classification_loss, int(shape[0])


def _lm_loss() -> Any:
    from jaxnn.train import lm_loss

    return lm_loss


def _text(trained: TrainedModel, data_dir: str | None) -> Any:
    """Text as the model's token ids: the run's own tokenizer where it recorded one, else bytes."""
    from jaxnn.data import TextCorpus, load_dataset, tokenize_corpus
    from jaxnn.data.records import is_record_source, load_text_records
    from jaxnn.interop.tokenizer import TOKENIZER_FILE, load_tokenizer, run_tokenizer_folder

    folder = run_tokenizer_folder(trained.config, trained.directory) if trained.config else None
    if data_dir and is_record_source(data_dir):
        return load_text_records(data_dir, None if folder is None else load_tokenizer(folder / TOKENIZER_FILE))
    corpus = load_dataset("text", data_dir)
    assert isinstance(corpus, TextCorpus)
    return corpus if folder is None else tokenize_corpus(corpus, folder / TOKENIZER_FILE)
