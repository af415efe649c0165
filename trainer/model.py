"""A small Llama-style decoder: token embedding, ``layers`` blocks of pre-norm causal
self-attention with rotary position embedding and a SwiGLU MLP, a final RMSNorm and an
LM head. Each ``Block`` is one FSDP2 unit in the reference trainer.

Parameter names are the same in every layout: blocks live in ``layers``, a
``ModuleDict`` keyed by the block's index in the whole model, and a pipeline stage is
the whole model with the blocks it does not own deleted and ``tok_embeddings``,
``norm`` and ``output`` set to None where another stage owns them. That is what lets a
checkpoint written under one pipeline split load under any other."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. ``max_seq_len`` bounds the rotary table; ``ffn_dim`` 0
    means the Llama choice, 8/3·dim rounded up to a multiple of 16."""

    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    max_seq_len: int = 64
    ffn_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "layers", "heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name}={getattr(self, name)} must be at least 1")
        if self.dim % self.heads != 0:
            raise ValueError(
                f"model dim {self.dim} does not divide into {self.heads} heads; "
                "choose dim a multiple of heads "
                f"(e.g. dim {self.heads * max(1, round(self.dim / self.heads))})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head dim {self.head_dim} (dim {self.dim} / heads {self.heads}) is odd; rotary "
                f"embedding rotates pairs of channels, so choose dim / heads even"
            )
        if self.ffn_dim < 0:
            raise ValueError(f"ffn_dim {self.ffn_dim} must be positive, or 0 for 8/3·dim")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def hidden_dim(self) -> int:
        """Width of the SwiGLU MLP."""
        if self.ffn_dim:
            return self.ffn_dim
        return 16 * math.ceil(8 * self.dim / 3 / 16)


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``[max_seq_len, head_dim]`` (the
    ``head_dim / 2`` frequencies repeated for both halves of the channel vector)."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), frequencies)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` of shape ``[batch, heads, seq, head_dim]`` by position."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    """Causal self-attention. Under tensor parallelism ``wq``/``wk``/``wv`` hold this
    rank's heads only, so the head count is read off the projections' output."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x``: ``[batch, seq, dim]``, the whole sequence; ``cos``/``sin``: rotary
        tables of at least ``seq`` rows."""
        batch, seq, _ = x.shape
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.wq, self.wk, self.wv)
        )
        cos, sin = cos[:seq], sin[:seq]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """``forward(tokens [batch, seq] int64) -> logits [batch, seq, vocab]``, with
    ``seq`` ≤ ``config.max_seq_len``. Weights are a function of ``seed`` only; the
    global torch RNG is left untouched.

    A pipeline stage (see ``trainer.pipeline``) lacks some of ``tok_embeddings``,
    ``layers`` entries, ``norm`` and ``output``: without ``tok_embeddings`` it takes the
    previous stage's hidden state instead of tokens, and without ``output`` it returns
    its hidden state."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleDict({str(index): Block(config) for index in range(config.layers)})
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        # Derived from the config, so kept out of the state dict and the checkpoint.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        # GPT-2/Llama practice: shrink the projections that write into the residual
        # stream so its variance does not grow with depth.
        residual_std = INIT_STD / math.sqrt(2 * self.config.layers)
        for name, parameter in self.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(parameter, std=residual_std, generator=generator)
            else:
                nn.init.normal_(parameter, std=INIT_STD, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            if x.shape[1] > self.config.max_seq_len:
                raise ValueError(
                    f"sequence of {x.shape[1]} tokens exceeds max_seq_len "
                    f"{self.config.max_seq_len}; raise max_seq_len"
                )
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x
