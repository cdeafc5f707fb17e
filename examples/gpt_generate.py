"""Train a small byte-level GPT (rotary positions, RMSNorm, grouped-query attention) and sample from it with the
KV cache.

    python examples/gpt_generate.py [--smoke]

The corpus is jaxnn's own source code; `jaxnn.generate.generate` decodes one compiled program: a prefill over
the prompt, then one position per step against the cached keys and values.
"""

import argparse
import pathlib

import jax
import numpy as np
import optax

import jaxnn
from jaxnn.generate import generate
from jaxnn.models import GPT, GPTConfig
from jaxnn.train import language_model_loss


def windows(corpus: np.ndarray, seq_len: int, n: int, seed: int = 0) -> dict:
    """`n` random windows of seq_len + 1 bytes: inputs and the same shifted by one (the next-byte targets)."""
    starts = np.random.default_rng(seed).integers(0, len(corpus) - seq_len - 1, n)
    tokens = np.stack([corpus[s : s + seq_len + 1] for s in starts]).astype(np.int32)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few steps")
    args = parser.parse_args()
    source = pathlib.Path(jaxnn.__file__).parent
    corpus = np.frombuffer(b"".join(p.read_bytes() for p in sorted(source.rglob("*.py"))), np.uint8)
    cfg = GPTConfig(seq_len=64, d_model=128, num_layers=4, num_heads=4, position="rope", norm="rms", num_kv_heads=2)
    if args.smoke:
        cfg = GPTConfig(seq_len=16, d_model=32, num_layers=1, num_heads=2, position="rope", norm="rms", num_kv_heads=1)
    steps = 10 if args.smoke else 1500
    model = GPT(cfg)
    result = jaxnn.fit(
        model,
        windows(corpus, cfg.seq_len, 64 * steps),
        loss=language_model_loss,
        optimizer=optax.adamw(optax.warmup_cosine_decay_schedule(0, 3e-3, steps // 10, steps)),
        steps=steps,
        batch_size=64,
        progress=not args.smoke,
    )
    prompt = np.frombuffer(b"def ", np.uint8)[None].astype(np.int32)
    tokens = generate(
        model,
        result.state.params,
        prompt,
        40 if args.smoke else 300,
        key=jax.random.key(0),
        temperature=0.8,
        top_p=0.95,
    )
    print(bytes(np.asarray(tokens[0]).astype(np.uint8)).decode("utf-8", "replace"))


if __name__ == "__main__":
    main()
