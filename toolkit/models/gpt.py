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


# ~0.1M parameters at a 60-character vocabulary; gpt-mini has 4 blocks (~0.2M), enough for 4 pipeline stages.
GPT_SIZES = {"gpt-tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=64),
             "gpt-mini": dict(n_layer=4, n_head=4, n_embd=64, block_size=64)}


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention with q, k and v as three projections, so a tensor-parallel mesh splits
    each by heads (GPT._tp_plan). Shapes are read from the tensors (-1 heads of head_dim), so the same forward
    runs on all heads or on one rank's share of them."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim, self.dropout = cfg.n_embd // cfg.n_head, cfg.dropout
        self.q, self.k, self.v = (nn.Linear(cfg.n_embd, cfg.n_embd) for _ in range(3))
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self._register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q, k, v = (layer(x).view(batch, time, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                             is_causal=True)
        return self.resid_drop(self.proj(out.transpose(1, 2).reshape(batch, time, -1)))


def _split_fused_qkv(state_dict, prefix, *args):
    """A checkpoint written before q, k and v were split (one `qkv` Linear, rows q then k then v) loads as three."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
        if fused is not None:
            for name, part in zip("qkv", fused.chunk(3)):
                state_dict[f"{prefix}{name}.{kind}"] = part


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
    # How a tensor-parallel mesh splits the model (transformers' `_tp_plan` convention: module-name patterns, `*`
    # for a block's number, mapped to styles that toolkit/engines/tensor_parallel.py defines). Megatron's split:
    # attention by heads and the MLP by its hidden units, each a column-wise layer then a row-wise one, so a block
    # communicates twice; the residual stream and the norms are split along the sequence between them (sequence
    # parallel), and the tied embedding/head by vocabulary rows, the logits staying split for the loss.
    _tp_plan = {
        "tok_emb": "embedding",
        "pos_emb": "replicate",
        "drop": "sequence_split",
        "blocks.*.ln1": "sequence_parallel",
        "blocks.*.attn": "sequence_gather",
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise_sequence",
        "blocks.*.ln2": "sequence_parallel",
        "blocks.*.mlp": "sequence_gather",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise_sequence",
        "ln_f": "sequence_parallel",
        "head": "loss_parallel",
    }
    # Where pipeline stages cut (toolkit/engines/pipeline.py): between the blocks; the first stage also runs `embed`
    # with its modules, the last `output` with its.
    _pp_plan = {"embed": ["tok_emb", "pos_emb", "drop"], "blocks": "blocks", "output": ["ln_f", "head"]}

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise UserError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}; change one of them.")
        self.cfg = cfg
        self.tp_heads = cfg.n_head  # what a tensor-parallel mesh splits attention by: its size must divide it
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
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.output(x)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Tokens (batch x time) to the residual stream: token plus position embeddings."""
        time = idx.shape[1]
        if time > self.cfg.block_size:
            raise ValueError(f"a sequence of {time} tokens is longer than block_size {self.cfg.block_size}")
        # The position embedding is called as a module, not indexed: under FSDP its weight is gathered by its call.
        return self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(time, device=idx.device)))

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream to logits over the vocabulary."""
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
