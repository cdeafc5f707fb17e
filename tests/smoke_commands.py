"""The smoke tier's registry: the smallest run of every make target (what `make help` prints), of every runnable
module of benchmarks/ and experiments/, and of every command in README.md's and docs/*.md's shell blocks.
tests/system/test_smoke.py runs each line once; tests/test_smoke_coverage.py fails on anything left out.

- `RUNS`: command lines, run from a copy of the checkout (`make ...` with this interpreter's venv, `jaxnn ...` and
  `python ...` with this interpreter). A target is covered by a line that runs it; a module by a line that runs it,
  by a covered target whose recipe runs it, or by its parent in `CHILDREN`.
- `EXEMPT`: targets and modules with no smoke run, and why (a GPU twin runs instead, the network, the suite itself).
- `DOC_COMMANDS`: each documented command as written (its comment left out) -> the line that runs it at a tiny
  size, or `COVERED_BY + the test` that runs it as written. A documented command that is not run carries a
  visible marker in the docs instead: a trailing comment with `NOT_RUN`, saying why.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]

TRAIN_TINY = "--steps 2 --no-summary --no-progress"

RUNS: list[str] = [
    # make targets, smallest documented sizes
    f"make train ARGS='{TRAIN_TINY}'",
    "make bench ARGS='--quick --models tiny --precisions fp32 --no-scan'",
    "make bench-peers ARGS='--quick --models tiny --precisions fp32 --repeats 1 --json peers-smoke.json'",
    "make bench-generation ARGS='--size small --prompt 8 --new-tokens 8 --batch 1 --no-cache-batches 1 --rounds 1'",
    "make bench-gpu-dry",
    "python -m benchmarks.mfu_levers --dry-run --budget-s 5 --out-dir levers-smoke",
    "make bench-augment ARGS='--batch 8 --steps 2 --repeats 1 --out augment-smoke.json'",
    "make bench-remat ARGS='--seq-lens 64 --policies none --steps 1'",
    # the quantised bases' rows run in gpu-check's dry run (its LoRA child)
    "make bench-lora ARGS='--models gpt2-small --ranks 4 --batch 1 --seq-len 16 --steps 1 --bases'",
    "make bench-input ARGS='--steps 2 --repeats 1 --batch-size 8 --out input-smoke.json'",
    f"make train-gpt ARGS='{TRAIN_TINY} --size small'",
    "make docs",
    "make exp-matmul SIZE=tiny",
    "make exp-precision SIZE=tiny",
    "make exp-sequential SIZE=tiny",
    "make exp-pipeline SIZE=tiny",
    "make exp-inference SIZE=tiny",
    "make exp-parallel SIZE=tiny",
    "make exp-train SIZE=tiny",
    "make exp-roofline SIZE=tiny",
    "make project-gpu SIZE=tiny",
    "make report",
    "make experiments SIZE=tiny",
    "make mutate ARGS=\"--only 'same dropout key every step' --jobs 1\"",
    "make onednn",
    "make bench-onednn ARGS='--rounds 1 --repeats 1 --no-steps --no-ab --json onednn-smoke.json'",
    "make bench-parallel PARALLEL_ARGS='--devices 1 2 --global-batch 16 --repeats 1' ARGS='--d-model 32 --layers 1'",
    "make bench-sharding ARGS='--d-model 32 --layers 1'",
    "make bench-serve ARGS='--size small --concurrency 1 2 --prompt 8 --new-tokens 4 --no-transformers'",
    "make train-multihost PARALLEL_ARGS='-- --steps 2 --no-progress'",
    "make profile MODEL=mlp ARGS='--out profile-smoke'",
    # modules no target runs
    "python -m benchmarks.ab_bf16_layout --models cnn --repeats 1",
    # benchmarks.ab_conv: its documented capped run below
    "python -m benchmarks.ab_max_pool --repeats 1",
    "python -m benchmarks.ab_train_step tiny --rounds 1",
    "python -m benchmarks.ab_widened_bf16 mlp --rounds 1 --repeats 1",
    "python -m benchmarks.ab_xla_cpu dots --size 128 --repeats 1",
    "python -m benchmarks.accumulate_memory --batch 64 --width 16 --k 1 2",
    "python -m benchmarks.attention_cpu --shapes 1x64x2x16 --blocks 1 2 --repeats 1",
    "python -m benchmarks.checkpoint_saving --width 32 --steps 4 --every 2 --rounds 1",
    "python -m benchmarks.compile_time --layers 1 2",
    "python -m benchmarks.fp8_matmul --sizes 128 --repeats 1",
    "python -m benchmarks.host_memory --models tiny --precisions fp32 --rounds 1 --steps 2 --warmup 1",
    "make onednn && python -m benchmarks.onednn_load --precisions fp32 --repeats 1",
    "python -m benchmarks.startup --models mlp --rounds 1 --steps 5",
    "python -m benchmarks.step_variants --size tiny --repeats 1",
    "python -m benchmarks.tiny_step --precisions fp32 --repeats 1",
    "python -m experiments.project_model --model mlp --batches 1 --repeats 1",
]

EXEMPT: dict[str, str] = {
    "test": "the fast tier of this suite itself",
    "test-all": "this suite itself (CI runs it)",
    "lint": "make test and make test-all run it first",
    "typecheck": "make test-all runs it first",
    "install-bench": "installs the peer libraries from the network",
    "bench-gpu": "needs a GPU; bench-gpu-dry runs its code path on the CPU",
    "gpu-check": "needs a GPU; gpu-check-dry runs its code path on the CPU",
    "gpu-levers": "needs a GPU; python -m benchmarks.mfu_levers --dry-run runs its code path on the CPU",
    "gpu-check-dry": "tests/system/test_experiments.py's dry_run fixture runs its command (gpu_check --dry-run with "
    "an archive) once for the suite, and checks every row it writes",
    "experiments.gpu_check": "gpu-check-dry's module: the same dry_run fixture runs it",
}

# Modules another module starts as children (by name prefix), and that parent.
CHILDREN: dict[str, str] = {"benchmarks.peers.peer_": "benchmarks.peers"}

# docs/parallel.md's rules file for the built-in mlp (layers 1_dense, 3_dense, 5_logits), as written there:
# tests/test_shard_rules.py checks that the docs hold this line and runs it.
MLP_RULES_ECHO = (
    """echo '{"*1_dense.w": [null, "tensor"], "*1_dense.b": ["tensor"], "*3_dense.w": ["tensor", null]}' > rules.json"""
)

COVERED_BY = "covered by "
NOT_RUN = "not run by the tests:"

KERNEL_TABLE_RUN = (
    "jaxnn train --model cnn --profile-dir runs/trace-k --steps 6 --no-summary --no-progress && "
    "python -m jaxnn.profile.kernel_table runs/trace-k && "
    "python -m jaxnn.profile.kernel_table runs/trace-k --top 40 --json"
)
DOC_COMMANDS: dict[str, str] = {
    # README.md
    "make experiments": "make experiments SIZE=tiny",
    "make report": "make report",
    "make train DEVICES=8": f"make train DEVICES=8 ARGS='{TRAIN_TINY}'",
    "jaxnn train --model gpt --mesh tensor=2,fsdp=4": (
        f"jaxnn train --model gpt --mesh tensor=2,fsdp=4 --size small --seq-len 32 {TRAIN_TINY}"
    ),
    "make train-multihost": "make train-multihost PARALLEL_ARGS='-- --steps 2 --no-progress'",
    "make train": f"make train ARGS='{TRAIN_TINY}'",
    "make train MODEL=gpt": f"make train MODEL=gpt ARGS='{TRAIN_TINY} --size small'",
    "make train ARGS='--precision bf16 --steps 2000 --ckpt-every 200 --resume --run-dir runs/mine'": (
        "make train ARGS='--precision bf16 --steps 4 --ckpt-every 2 --resume --run-dir runs/mine --no-summary'"
    ),
    "jaxnn summary --model llama-3-8b": "jaxnn summary --model llama-3-8b",
    # docs/training.md
    "WANDB_MODE=offline jaxnn train --metrics wandb mlflow --run-dir runs/tracked": (
        f"WANDB_MODE=offline WANDB_SILENT=true jaxnn train --metrics wandb mlflow --run-dir runs/tracked {TRAIN_TINY}"
    ),
    # docs/bring-a-checkpoint.md
    "jaxnn summary --model gpt2 --model-config num_layers=2": "jaxnn summary --model gpt2 --model-config num_layers=2",
    "jaxnn train --model gpt2 --model-config num_layers=2 d_model=128 num_heads=4 --steps 50": (
        "jaxnn train --model gpt2 --model-config num_layers=2 d_model=128 num_heads=4 --seq-len 32 "
        f"--batch-size 2 {TRAIN_TINY}"
    ),
    "jaxnn profile --model gpt2 --batch-size 1 --seq-len 128 --precision fp32": (
        "jaxnn profile --model gpt2 --model-config num_layers=1 --batch-size 1 --seq-len 128 --precision fp32"
    ),
    # docs/serving.md
    "jaxnn train --model gpt --size small --steps 200 --run-dir runs/gpt": (
        f"jaxnn train --model gpt --size small --seq-len 32 --run-dir runs/gpt {TRAIN_TINY}"
    ),
    "jaxnn serve runs/gpt --port 8000": COVERED_BY + "tests/system/test_serve_http.py (a trained run, served)",
    "jaxnn serve runs/gpt --port 8000 --warm-up 64": COVERED_BY
    + "tests/system/test_serve_http.py (a trained run, served after --warm-up)",
    # docs/checkpoints.md: a run to export first
    "jaxnn export --run-dir runs/cnn-default/20261201-024845 --out exported/cnn --platforms cpu cuda": (
        f"jaxnn train {TRAIN_TINY} --run-dir runs/cnn-default/20261201-024845 && "
        "jaxnn export --run-dir runs/cnn-default/20261201-024845 --out exported/cnn --platforms cpu cuda"
    ),
    # docs/getting-started.md
    "make install": COVERED_BY + "make test and make test-all, which install through it",
    "jaxnn train --steps 5 --run-dir runs/first": "jaxnn train --steps 5 --run-dir runs/first --no-progress",
    # docs/parallel.md
    "jaxnn train --model mlp --mesh tensor=8 --sharding-rules rules.json": (
        f"{MLP_RULES_ECHO} && jaxnn train --model mlp --mesh tensor=8 --sharding-rules rules.json {TRAIN_TINY}"
    ),
    'make train-multihost PARALLEL_ARGS="--devices-per-process 2 -- --model cnn --steps 500 --no-progress"': (
        'make train-multihost PARALLEL_ARGS="--devices-per-process 2 -- --model cnn --steps 2 --no-progress"'
    ),
    # docs/performance.md
    "make bench-peers ISA=avx2": (
        # two peers: one under gdb (every XLA peer starts there where gdb is installed), PyTorch without it
        "make bench-peers ISA=avx2 ARGS='--quick --peers jaxnn pytorch --models tiny --precisions fp32 --repeats 1 "
        "--json peers-avx2.json'"
    ),
    "python -m benchmarks.ab_conv --isa avx2": "python -m benchmarks.ab_conv --isa avx2 --repeats 1",
    "python -m benchmarks.ab_widened_bf16 --isa avx2": (
        "python -m benchmarks.ab_widened_bf16 mlp --isa avx2 --rounds 1 --repeats 1"
    ),
    # docs/precision.md
    "python examples/bf16_vs_fp32.py": "python examples/bf16_vs_fp32.py",
    "make exp-precision": "make exp-precision SIZE=tiny",
    # docs/profiling.md
    "jaxnn profile --model cnn": "jaxnn profile --model cnn --batch-size 8",
    "jaxnn profile --model gpt --precision bf16 --batch-size 64 --out runs/prof-gpt": (
        "jaxnn profile --model gpt --precision bf16 --batch-size 2 --size small --out runs/prof-gpt"
    ),
    "make profile MODEL=gpt ARGS='--out runs/prof-gpt'": (
        "make profile MODEL=gpt ARGS='--out runs/prof-gpt --batch-size 2 --size small'"
    ),
    "jaxnn train --model cnn --profile-dir runs/trace": (
        "jaxnn train --model cnn --profile-dir runs/trace --steps 12 --no-summary --no-progress"
    ),
    "make train ARGS='--profile-dir runs/trace'": (
        "make train ARGS='--profile-dir runs/trace --steps 12 --no-summary --no-progress'"
    ),
    # one run for both (smoke_lines runs a line once)
    "python -m jaxnn.profile.kernel_table runs/trace": KERNEL_TABLE_RUN,
    "python -m jaxnn.profile.kernel_table runs/trace --top 40 --json": KERNEL_TABLE_RUN,
}

# The docs' walk-through, run as written by tests/system/test_docs_paths.py.
_WALKTHROUGH = COVERED_BY + "tests/system/test_docs_paths.py, as written"
for _line in (
    "jaxnn train --init-from tiny-gpt2 --data qa.jsonl --lora r=8,alpha=16 --steps 30 --batch-size 8 --seq-len 32 "
    "--lr 3e-3 --run-dir ft --no-progress --no-plots",
    'jaxnn generate --run-dir ft --prompt "def f3(x):" --length 8 --temperature 0',
    "jaxnn export --run-dir ft --format hf --out ft-hf",
    "jaxnn export --run-dir ft --format lora --out ft-adapters",
    "jaxnn export --run-dir ft --format peft --out ft-peft",
    "jaxnn train --init-from tiny-gpt2 --data qa.jsonl --lora r=8,alpha=16,base=nf4 --steps 30 --batch-size 8 "
    "--seq-len 32 --lr 3e-3 --run-dir ft-nf4 --no-progress --no-plots",
    'jaxnn generate --run-dir ft-nf4 --prompt "def f3(x):" --length 8 --temperature 0',
    "jaxnn export --run-dir ft-nf4 --format hf --out ft-nf4-hf",
):
    DOC_COMMANDS[_line] = _WALKTHROUGH
for _line in (
    "jaxnn train --init-from tiny-gpt2 --data pairs.jsonl --objective dpo --beta 0.1 --lora r=8,alpha=16 --steps 40 "
    "--batch-size 8 --seq-len 32 --lr 3e-3 --log-every 10 --run-dir dpo --no-progress --no-plots",
    'jaxnn generate --run-dir dpo --prompt "def f3(x):" --length 8 --temperature 0',
):
    DOC_COMMANDS[_line] = _WALKTHROUGH

_COMMAND = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S+ )*(?:jaxnn|python3?|make|\.venv/bin/python) ")


def documented_commands(root: pathlib.Path = ROOT) -> list[tuple[str, str, str]]:
    """(file, command as written without its comment, the comment) for every command line in a non-Python fenced
    block of README.md and docs/*.md."""
    found = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), flags=re.S | re.M):
            if lang in ("python", "yaml", "json", "text"):
                continue
            for line in body.splitlines():
                line = line.strip().removeprefix("$ ")
                if not _COMMAND.match(line + " "):
                    continue
                command, _, comment = line.partition(" #")
                found.append((path.name, command.strip().removesuffix("&").strip(), comment.strip()))
    return found


def help_targets(root: pathlib.Path = ROOT) -> list[str]:
    """The targets `make help` prints, in its order."""
    out = subprocess.run(["make", "-s", "-C", str(root), "help"], capture_output=True, text=True, check=True).stdout
    return [line.split()[1] for line in out.splitlines() if line.startswith("make ")]


def recipe_modules(root: pathlib.Path = ROOT) -> dict[str, list[str]]:
    """target -> the `python -m` modules of benchmarks/ and experiments/ its recipe runs."""
    found: dict[str, list[str]] = {}
    for path in [root / "Makefile", *sorted((root / "mk").glob("*.mk"))]:
        target = None
        for line in path.read_text().splitlines():
            head = re.match(r"^([a-z][a-z0-9-]*):", line)
            if head:
                target = head.group(1)
            elif line.startswith("\t") and target:
                found.setdefault(target, []).extend(re.findall(r"-m ((?:benchmarks|experiments)[\w.]*)", line))
    return found


def results_paths(root: pathlib.Path = ROOT) -> list[tuple[str, str]]:
    """(target, path) for every path under results/ that a recipe of the Makefile or mk/*.mk names."""
    found = []
    for path in [root / "Makefile", *sorted((root / "mk").glob("*.mk"))]:
        target = None
        for line in path.read_text().splitlines():
            head = re.match(r"^([a-z][a-z0-9-]*):", line)
            target = head.group(1) if head else target
            if line.startswith("\t") and target:
                found += [(target, p) for p in re.findall(r"(?<![\w/])results/[^\s'\"]*", line)]
    return found


def entry_modules(root: pathlib.Path = ROOT) -> list[str]:
    """Every module of benchmarks/ and experiments/ that runs as a program (a `__main__` block, or a package's
    `__main__.py`)."""
    names = []
    for package in ("benchmarks", "experiments"):
        for path in sorted((root / package).rglob("*.py")):
            if "__main__" not in path.read_text():
                continue
            parts = path.relative_to(root).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return names


def smoke_lines() -> list[str]:
    """Every line the smoke tier runs, once each: `RUNS` and the documented commands' tiny runs."""
    lines = list(RUNS)
    for line in DOC_COMMANDS.values():
        if not line.startswith(COVERED_BY) and line not in lines:
            lines.append(line)
    return lines


def _runs(lines: list[str]) -> tuple[set[str], set[str]]:
    """(make targets, python -m modules of benchmarks/ and experiments/) that `lines` run; the library's own
    modules (`python -m jaxnn...`) are documented commands, covered as such."""
    targets, modules = set(), set()
    for line in lines:
        for part in line.split(" && "):
            argv = shlex.split(part)
            if argv[0] == "make":
                targets.update(a for a in argv[1:2] if "=" not in a)
            elif argv[0] == "python" and argv[1:2] == ["-m"] and not argv[2].startswith("jaxnn."):
                modules.add(argv[2])
    return targets, modules


def uncovered(root: pathlib.Path = ROOT, lines: list[str] | None = None) -> list[str]:
    """Targets, entry modules and documented commands with neither a smoke run nor an exemption (or marker)."""
    targets, modules = _runs(smoke_lines() if lines is None else lines)
    missing = [t for t in help_targets(root) if t not in targets and t not in EXEMPT]
    modules |= {m for t, ms in recipe_modules(root).items() if t in targets for m in ms}
    for module in entry_modules(root):
        parent = next((p for prefix, p in CHILDREN.items() if module.startswith(prefix)), module)
        if parent not in modules and module not in EXEMPT:
            missing.append(module)
    for name, command, comment in documented_commands(root):
        if command not in DOC_COMMANDS and NOT_RUN not in comment:
            missing.append(f"{name}: {command}")
    return missing
