"""Training curves as PNG files (loss, and accuracy or bits per token) from a run's metrics.jsonl."""

from __future__ import annotations

import contextlib
import pathlib
import threading

from jaxnn._src.storage import PathLike
from jaxnn.metrics import read_jsonl

# (file name, metric): the first metric found for a file name wins.
CURVES = (("loss", "loss"), ("accuracy", "accuracy"), ("accuracy", "bits_per_token"))


def preload() -> threading.Thread:
    """Imports matplotlib in a background thread while the training steps run (the main thread mostly waits on
    the device then): the import took ~0.8 s of the plots' 1.2 s at the end of a run (docs/performance.md)."""

    def load() -> None:
        # A failed import here only means the plots import it again at the end, where errors are reported.
        with contextlib.suppress(Exception):
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot  # noqa: F401

    thread = threading.Thread(target=load, name="jaxnn-preload-matplotlib", daemon=True)
    thread.start()
    return thread


def write_plots(metrics_path: PathLike, out_dir: PathLike) -> list[str]:
    """Writes loss.png and accuracy.png (bits per byte for text) into `out_dir`; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_path, out_dir = pathlib.Path(metrics_path), pathlib.Path(out_dir)
    series: dict[tuple[str, str], dict[int, float]] = {}
    for row in read_jsonl(metrics_path):  # a resumed run re-logs some steps: the later line wins
        for key, value in row.items():
            if key not in ("split", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault((row.get("split", "train"), key), {})[row["step"]] = value
    paths, done = [], set()
    for name, key in CURVES:
        curves = {split: sorted(series[(split, key)].items()) for split in ("train", "eval") if (split, key) in series}
        if not curves or name in done:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for split, points in curves.items():
            ax.plot(*zip(*points), marker="o" if split == "eval" else None, label=split)
        ax.set(xlabel="step", ylabel=key, title=f"{key} ({metrics_path.parent.name})")
        ax.grid(alpha=0.3)
        ax.legend()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(str(path))
        done.add(name)
    return paths
