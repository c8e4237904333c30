"""A small decoder-only transformer and deterministic synthetic data, for the fsdpd demo,
the training benchmark and equivalence tests.

Plain torch (no nn.Transformer, whose fast paths differ between train and eval), only ops
that are deterministic on CPU. Import it with examples/ on sys.path:

    from transformer import Config, TinyGPT, Block, batch, rank_slice, loss_fn

    cfg = Config()                                   # vocab 512, d_model 128, 4 blocks, seq 64
    model = TinyGPT(cfg, seed=0)                     # same seed -> same weights on every rank
    tokens, targets = batch(step, global_batch=16, seq_len=cfg.seq_len, vocab=cfg.vocab)
    x, y = rank_slice((tokens, targets), rank, world_size)   # this rank's rows
    loss = loss_fn(model(x), y)                      # mean cross entropy over its tokens

API:
  Config(vocab, d_model, n_heads, n_layers, seq_len, mlp_ratio)   the sizes (a dataclass)
  TinyGPT(cfg, seed)   token embedding + learned positions, n_layers Blocks, final LayerNorm,
                       output head (not tied); forward(tokens [B, T] long) -> logits [B, T, V]
  Block                one pre-LayerNorm block: x + attn(ln1(x)), then x + mlp(ln2(x)); the
                       class to wrap (fsdpd.torch.shard_model(..., wrap={Block}))
  batch(step, global_batch, seq_len, vocab, seed=0) -> (tokens, targets), both [B, T] long,
                       the same in every process for the same arguments; targets are the
                       tokens shifted by one
  rank_slice(t, rank, world_size)   rank's equal share of the rows of a tensor (or of each
                       tensor of a tuple); global_batch must divide by world_size
  loss_fn(logits, targets)         mean cross entropy over every token

With equal slices, the mean over ranks of their losses is the loss of the whole global batch,
and the sum of their gradients / world_size is its gradient: what data-parallel training and
fsdpd's averaging reduce-scatter compute.

The data: each sequence counts up from a random start with a random stride from a small set
(mod vocab), with a few tokens replaced by noise; a model learns to predict the next token
from the previous two, so the loss falls within tens of steps.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Config", "TinyGPT", "Block", "batch", "rank_slice", "loss_fn"]


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    seq_len: int = 64
    mlp_ratio: int = 4

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must divide by n_heads {self.n_heads}")


class SelfAttention(nn.Module):
    """Multi-head causal self-attention, written out (no fused kernels)."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=2)
        # [B, T, D] -> [B, H, T, D/H]
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // h)
        # The causal mask is made here rather than kept as a buffer: a module without
        # buffers has nothing for DDP to broadcast (gloo cannot send bool tensors).
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention, then an MLP, each with a residual."""

    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Decoder-only transformer; the same (cfg, seed) gives the same weights anywhere."""

    def __init__(self, cfg=Config(), seed=0):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed):
        # GPT-2 style, from a private generator (the global RNG is neither used nor moved):
        # N(0, 0.02) weights, residual output projections scaled by 1/sqrt(2 n_layers),
        # zero biases, LayerNorms at identity.
        g = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            elif name.endswith("attn.proj.weight") or name.endswith(".out.weight"):
                p.normal_(0.0, resid_std, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)

    def forward(self, tokens):
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens; the model takes at most "
                             f"{self.cfg.seq_len}")
        x = self.tok(tokens) + self.pos[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


_STRIDES = (1, 2, 3, 5, 7)


def batch(step, global_batch, seq_len, vocab, seed=0):
    """(tokens, targets) of one global batch, [global_batch, seq_len] int64 each, a function
    of its arguments only (a generator seeded from seed and step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (global_batch, 1), generator=g)
    stride = torch.tensor(_STRIDES)[torch.randint(0, len(_STRIDES), (global_batch, 1),
                                                  generator=g)]
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    noise = torch.rand(global_batch, seq_len + 1, generator=g) < 0.05
    seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def rank_slice(t, rank, world_size):
    """Rows [rank * B/W, (rank + 1) * B/W) of t, or of each tensor of a tuple/list t."""
    if isinstance(t, (tuple, list)):
        return type(t)(rank_slice(x, rank, world_size) for x in t)
    rows = t.shape[0]
    if not 0 <= rank < world_size or rows % world_size:
        raise ValueError(f"rank {rank} of {world_size}: a batch of {rows} rows must split "
                         "into equal slices")
    n = rows // world_size
    return t[rank * n:(rank + 1) * n]


def loss_fn(logits, targets):
    """Mean cross entropy over every token of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
