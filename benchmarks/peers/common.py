"""The command line every peer module shares: build each (model, precision) step, time it, write JSON rows."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable

from benchmarks.train_steps import PRECISIONS, SPECS
from jaxnn.profile.timing import time_fn


def main(
    library: str,
    build: Callable[[str, str], Callable[[], object]],
    argv=None,
    describe: Callable[[str, str], str] | None = None,
) -> int:
    """Times `build(model, precision)()` for every requested pair and writes one JSON object (stdout or --out);
    `describe(model, precision)`, where given, names the kernels the row ran on (its "kernels" field)."""
    parser = argparse.ArgumentParser(prog=f"benchmarks.peers ({library})")
    parser.add_argument("--models", nargs="+", choices=list(SPECS), default=list(SPECS))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    rows = []
    for name in args.models:
        for precision in args.precisions:
            row = {"library": library, "model": name, "precision": precision}
            try:
                t0 = time.perf_counter()
                step = build(name, precision)
                timing = time_fn(step, repeats=args.repeats)
                row.update(step_ms=timing.median * 1e3, timing=timing.as_dict(), wall_s=time.perf_counter() - t0)
                if describe is not None:
                    row["kernels"] = describe(name, precision)
            except Exception as err:  # one failing configuration must not hide the others' figures
                row["error"] = f"{type(err).__name__}: {err}"[:300]
                traceback.print_exc(file=sys.stderr)
            rows.append(row)
            print(
                f"{library:12} {name:5} {precision:5} "
                + (f"{row['step_ms']:.4g} ms" if "step_ms" in row else row["error"]),
                file=sys.stderr,
            )
    text = json.dumps({"library": library, "rows": rows}, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0
