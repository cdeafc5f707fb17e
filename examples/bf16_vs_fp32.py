"""bf16 against fp32 on the machine at hand: one training step of each model under both precision policies, timed
side by side, with the CPU it ran on.

    python examples/bf16_vs_fp32.py [--smoke] [--repeats 7] [--fp8]

Whether bf16 is faster depends on the hardware, not on jaxnn: a bf16 x bf16 -> f32 product runs on GPU tensor
cores and on Intel's AMX units fast, while a CPU without them (no `amx_bf16` or `avx512_bf16` in /proc/cpuinfo)
converts bf16 in software and is usually slower in bf16 than in fp32. The ratio printed is fp32 time / bf16 time:
above 1, bf16 is faster here.
"""

import argparse
import pathlib

import jax
import optax

from jaxnn import models
from jaxnn.profile.timing import stepper, time_interleaved
from jaxnn.train import classification_loss, create_train_state, lm_loss, make_train_step

MATRIX_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")


def cpu_description() -> str:
    """The CPU's model name and which of its bf16 matrix features it has, from /proc/cpuinfo (Linux)."""
    info = pathlib.Path("/proc/cpuinfo")
    if not info.exists():
        return "unknown CPU (no /proc/cpuinfo)"
    fields: dict[str, str] = {}
    for line in info.read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's entry; all cores are alike
    present = [f for f in MATRIX_FLAGS if f in fields.get("flags", "").split()]
    # A virtual machine's model name can be generic ("Intel(R) Xeon(R) Processor"); family and model pin it down.
    name = f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"
    return f"{name}; bf16 matrix features: {', '.join(present) or 'none'}"


def workloads(smoke: bool) -> dict:
    """name -> (model, loss, a batch of random data): an MLP (nothing but matmuls) and a small GPT; with `smoke`, a
    tiny MLP alone (two compilations of a GPT step would be most of the smoke run's time)."""
    batch, width = (32, 64) if smoke else (256, 1024)
    keys = jax.random.split(jax.random.key(0), 3)
    image = {"x": jax.random.normal(keys[0], (batch, 28, 28, 1)), "y": jax.random.randint(keys[1], (batch,), 0, 10)}
    mlp = models.MLP(models.MLPConfig(hidden=(width, width)))
    found = {f"MLP {width}x{width}, batch {batch}": (mlp, classification_loss, image)}
    if not smoke:
        cfg, gpt_batch = models.GPTConfig(), 8
        tokens = jax.random.randint(keys[2], (gpt_batch, cfg.seq_len + 1), 0, cfg.vocab_size)
        text = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
        found[f"GPT d={cfg.d_model} x{cfg.num_layers}, {gpt_batch}x{cfg.seq_len}"] = (models.GPT(cfg), lm_loss, text)
    return found


def time_policies(model, loss, batch, repeats: int, policies=("fp32", "bf16")) -> dict:
    """Seconds per train step (median) for each policy, measured in the same windows so machine load hits all."""
    steps = {}
    for policy in policies:
        tx = optax.adam(1e-3)
        state = create_train_state(model, tx, jax.random.key(1), batch["x"].shape, policy=policy)
        steps[policy] = stepper(make_train_step(model, loss, tx, policy), state, batch)
    timings = time_interleaved(steps, warmup=2, repeats=repeats)
    return {policy: t.median for policy, t in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="a tiny MLP and few repeats, to check the example runs")
    parser.add_argument("--repeats", type=int, default=None, help="timing windows per policy (default 7; smoke 2)")
    parser.add_argument("--fp8", action="store_true", help="time fp8 too (emulated on a CPU: no CPU has fp8 units)")
    args = parser.parse_args()
    policies = ("fp32", "bf16", "fp8") if args.fp8 else ("fp32", "bf16")
    repeats = args.repeats or (2 if args.smoke else 7)
    device = jax.devices()[0]
    print(f"CPU: {cpu_description()}")
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}), medians of {repeats} windows")
    print(
        f"{'model':32} {'fp32 ms':>9} {'bf16 ms':>9} {'fp32/bf16':>10}"
        + (f" {'fp8 ms':>9} {'fp32/fp8':>9}" if args.fp8 else "")
    )
    for name, (model, loss, batch) in workloads(args.smoke).items():
        ms = {policy: 1e3 * s for policy, s in time_policies(model, loss, batch, repeats, policies).items()}
        fp8 = f" {ms['fp8']:9.2f} {ms['fp32'] / ms['fp8']:8.2f}x" if args.fp8 else ""
        print(f"{name:32} {ms['fp32']:9.2f} {ms['bf16']:9.2f} {ms['fp32'] / ms['bf16']:9.2f}x{fp8}")


if __name__ == "__main__":
    main()
