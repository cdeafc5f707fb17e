"""Where random crop and flip run (`make bench-augment`): on the host in numpy, or inside the train step on the device.

The measurement and its table are `experiments.augment_split`'s (claim 5 records the same figures as its `split`):
the CNN on 32x32x3 images, host crop+flip against `jaxnn.augment` in the step, side by side in one run, with a
projected accelerator row (projected, not measured). This command prints the table and writes the record.
"""

from __future__ import annotations

import argparse
import json
import os

from experiments.augment_split import format_table, measure


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.augment_placement", description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="streamed steps per placement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench-augment.json")
    args = parser.parse_args(argv)
    result = measure(batch=args.batch, steps=args.steps, repeats=args.repeats)
    print(format_table(result))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
