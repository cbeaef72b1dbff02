"""A small GPT for the training benchmark (benchmarks/bench_training.py).

Token and position embeddings, ``layers`` pre-LayerNorm transformer blocks (causal
self-attention through ``torch.nn.functional.scaled_dot_product_attention``, and a
4x GELU MLP), a final LayerNorm and an output head tied to the token embedding. The
data is a fixed random token stream (seeded), so that any machine can run it without
downloading anything; the loss does not matter, only that each step does the work of
a real one (forward, backward, AdamW).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    context: int = 128
    dim: int = 256
    layers: int = 4
    heads: int = 4
    batch: int = 4  # sequences per step
    # Recompute each block's activations in the backward (activation checkpointing, as
    # large-model training does): only the blocks' inputs are kept (by estimate, a batch
    # of 64 x 1024 tokens would otherwise fill most of an H100), and a step does about a
    # third more work.
    recompute: bool = False

    def params(self) -> int:
        """The number of parameters (the head is tied to the token embedding)."""
        per_block = 12 * self.dim * self.dim + 13 * self.dim  # qkv, proj, mlp, 2 LNs, biases
        return (self.vocab + self.context) * self.dim + self.layers * per_block + 2 * self.dim

    def describe(self) -> dict[str, int | bool]:
        return {**asdict(self), "params": self.params()}


# Presets: "smoke" for the test suite, "small" for a 2-core CPU (tens of MB of
# parameters), "gpu" for a GPU (about 0.9 billion parameters: 3.5 GB of fp32 weights,
# 10.5 GB with AdamW's moments; 64 x 1024 tokens per step with recomputed activations,
# about a second per step on an H100-class GPU, against 0.11 s at 8 x 1024 without: a
# snapshot every 10 steps of 0.11 s would ask for 10 GB/s of disk and spend a fifth of
# the interval in the 0.2 s device-to-host copy that snapcore's default mode waits for).
SIZES = {
    "smoke": GPTConfig(vocab=512, context=32, dim=64, layers=2, heads=2, batch=2),
    "small": GPTConfig(vocab=8192, context=128, dim=384, layers=4, heads=6, batch=2),
    "gpu": GPTConfig(
        vocab=32768, context=1024, dim=2048, layers=16, heads=16, batch=64, recompute=True
    ),
}


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.ln2 = nn.LayerNorm(c.dim)
        self.fc = nn.Linear(c.dim, 4 * c.dim)
        self.out = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.context, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * c.layers)
                    if name.endswith(("proj.weight", "out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        recompute = self.config.recompute and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.head(self.ln(x))


def build(c: GPTConfig, device: torch.device, seed: int = 0) -> tuple[GPT, torch.optim.AdamW]:
    """The model (fp32 weights) and its AdamW, on ``device``, initialised from ``seed``."""
    torch.manual_seed(seed)
    model = GPT(c).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


class Tokens:
    """A fixed random token stream (seeded) cut into batches, generated on the device."""

    def __init__(self, c: GPTConfig, device: torch.device, seed: int = 1234, batches: int = 64):
        g = torch.Generator().manual_seed(seed)
        n = batches * c.batch * c.context + 1
        self.stream = torch.randint(0, c.vocab, (n,), generator=g).to(device)
        self.c, self.batches = c, batches

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of batch ``i`` (the stream wraps around)."""
        span = self.c.batch * self.c.context
        start = (i % self.batches) * span
        x = self.stream[start : start + span].view(self.c.batch, self.c.context)
        y = self.stream[start + 1 : start + span + 1].view(self.c.batch, self.c.context)
        return x, y


def train_step(
    model: GPT,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    before_update: Callable[[], object] | None = None,
) -> torch.Tensor:
    """One step: forward (bf16 autocast on CUDA), backward, AdamW; ``before_update`` is
    called between the backward and the optimizer's step. Returns the loss."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
    del logits  # the backward does not need them (4.3 GB at the gpu size)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if before_update is not None:
        before_update()
    opt.step()
    return loss.detach()
