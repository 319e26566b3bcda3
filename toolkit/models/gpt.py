"""A small GPT for character-level language modelling, shaped as nanoGPT's model.py (Karpathy): token and
position embeddings, `n_layer` pre-LayerNorm blocks of causal self-attention
(torch.nn.functional.scaled_dot_product_attention with is_causal=True) and a GELU MLP, a final LayerNorm, and an
output head tied to the token embedding. `forward(idx)` maps int64 tokens (batch x time, time <= block_size) to
logits (batch x time x vocab_size). Like every model here it knows nothing about distribution: the blocks are a
ModuleList named `blocks`, which the fsdp engine's `shard_units` opens so each block is sharded on its own, and
the tied embedding/head weight is one it keeps whole. `GPT_SIZES` names the sizes; "gpt-tiny" trains on a CPU in
seconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.errors import UserError


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int  # the longest context, in tokens
    n_layer: int
    n_head: int
    n_embd: int  # width of the residual stream; a multiple of n_head
    dropout: float = 0.0  # 0 keeps a step independent of how the batch is split across ranks (no per-rank RNG)


# ~0.1M parameters at a 60-character vocabulary.
GPT_SIZES = {"gpt-tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64)}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).split(width, dim=2))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                             is_causal=True)
        return self.resid_drop(self.proj(out.transpose(1, 2).reshape(batch, time, width)))


class Block(nn.Module):
    """Pre-LN: x + attn(ln(x)), then x + mlp(ln(x)), so the residual stream itself is never normalised."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    _no_split_modules = ["Block"]  # transformers' convention: the blocks an FSDP profile shards one by one

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise UserError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}; change one of them.")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied (Press & Wolf 2017): one matrix reads and writes tokens
        self.apply(_init_weights)
        for block in self.blocks:  # GPT-2: residual projections scaled by depth, so the stream's variance stays put
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        time = idx.shape[1]
        if time > self.cfg.block_size:
            raise ValueError(f"a sequence of {time} tokens is longer than block_size {self.cfg.block_size}")
        # The position embedding is called as a module, not indexed: under FSDP its weight is gathered by its call.
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(time, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    """nanoGPT's initialisation: N(0, 0.02) weights for linear layers and embeddings, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_gpt(size: str, vocab_size: int, **overrides) -> GPT:
    """A GPT of a named size from GPT_SIZES for `vocab_size` tokens; `overrides` replace GPTConfig fields."""
    if size not in GPT_SIZES:
        raise UserError(f"Unknown GPT size {size!r}; choose one of {', '.join(GPT_SIZES)} with --model.")
    return GPT(dataclasses.replace(GPTConfig(vocab_size=vocab_size, **GPT_SIZES[size]), **overrides))
