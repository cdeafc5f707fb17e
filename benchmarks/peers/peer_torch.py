"""PyTorch (CPU build) peer: idiomatic nn.Modules (nanoGPT-style GPT with scaled_dot_product_attention, NCHW
convolutions), torch.optim.Adam; bf16 through `torch.autocast("cpu", torch.bfloat16)`, as PyTorch users do it."""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.peers.common import main
from benchmarks.train_steps import LEARNING_RATE, SPECS, synthetic_batch


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (
            t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(D, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, d_model, num_layers, num_heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(0.02 * torch.randn(seq_len, d_model))
        self.blocks = nn.Sequential(*[Block(d_model, num_heads) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(d_model, eps=1e-6)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.ln_f(self.blocks(x)))


def make_model(name: str) -> nn.Module:
    s = SPECS[name]
    if s["kind"] == "mlp":
        widths = (s["in_features"], *s["hidden"])
        layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
        return nn.Sequential(*layers, nn.Linear(widths[-1], s["classes"]))
    if s["kind"] == "cnn":
        chans = (s["image"][-1], *s["widths"])
        layers = [
            m for a, b in zip(chans, chans[1:]) for m in (nn.Conv2d(a, b, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        ]
        side = s["image"][0] // 2 ** len(s["widths"])
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(side * side * s["widths"][-1], s["classes"]))
    return GPT(s["vocab"], s["seq_len"], s["d_model"], s["num_layers"], s["num_heads"])


def build(name: str, precision: str):
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    model = make_model(name)
    opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    batch = synthetic_batch(name)
    x, y = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"]).long()
    if SPECS[name]["kind"] == "cnn":
        x = x.permute(0, 3, 1, 2).contiguous()  # PyTorch convolutions are NCHW
    else:
        x = x.long() if SPECS[name]["kind"] == "gpt" else x
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext

    def call():
        opt.zero_grad(set_to_none=True)
        with autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        return None  # the CPU build runs synchronously: the step is done when call() returns

    return call


if __name__ == "__main__":
    sys.exit(main("pytorch", build))
