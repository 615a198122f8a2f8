"""GPT-2 as in the paper and nanoGPT: learned position embeddings, pre-LayerNorm blocks, GELU (tanh),
a token embedding tied to the output layer, no dropout.

The model has one implementation switch, `flash` (attention written out, or F.scaled_dot_product_attention),
beside its shape (sizes, and the vocabulary padded to `vocab_multiple` rows), both in its config
(Utils.model_config, plain data that the report reads too). It knows nothing of the suite's kernels: an
addition that needs a faster implementation swaps a module in from outside (Utils.ladder.modules), as
gpt-fast's quantize.py swaps its Linear layers.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from Utils.model_config import GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.flash = config.flash
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.residual_scale = True
        if not self.flash:
            mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.flash:
            # One fused kernel (FlashAttention's algorithm) that never writes the T x T scores to memory.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # The B x H x T x T scores live in memory, are read and written by the mask and the softmax:
            # the memory traffic that FlashAttention removes.
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.residual_scale = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class OutputLoss(nn.Module):
    """The mean cross-entropy of the output layer's logits over the real vocabulary.

    A module of its own, given the (possibly padded) output weight, so that an addition can replace how the
    loss is made (the chunked loss never holds the logits whole) without the model knowing."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, weight)[..., :self.vocab_size]   # a full slice, a no-op, unless the vocabulary is padded
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight   # tied, as in GPT-2
        self.loss = OutputLoss(config.vocab_size)
        self.apply(self._init_weights)
        if config.padded_vocab_size != config.vocab_size:
            # Padded after the init, so that every weight is drawn exactly as without padding. The extra rows
            # are zeros, are cut from the logits before the loss, and so never receive a gradient.
            wte = self.transformer.wte
            pad = wte.weight.new_zeros(config.padded_vocab_size - config.vocab_size, config.n_embd)
            wte.weight = nn.Parameter(torch.cat([wte.weight.detach(), pad]))
            wte.num_embeddings = self.lm_head.out_features = config.padded_vocab_size
            self.lm_head.weight = wte.weight

    def _init_weights(self, module: nn.Module):
        # GPT-2: N(0, 0.02), and residual projections scaled by 1/sqrt(2 * n_layer) because each block
        # adds two of them to the residual stream.
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_scale", False):
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, exclude_position_embedding: bool = True) -> int:
        """Parameters counted once (the tied embedding once, its padding rows not at all); without wpe for
        the FLOPs formula."""
        n = sum(p.numel() for p in self.parameters())
        n -= (self.config.padded_vocab_size - self.config.vocab_size) * self.config.n_embd   # padding is not model
        if exclude_position_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits [B, T, vocab_size], None) without targets; (None, mean cross-entropy) with them.

        A training step gets no logits: logits returned from a compiled forward are written out whole and held
        by the caller, beside what the loss keeps for backward (24.5 GiB more at batch 64 on the fused rung,
        BENCHMARKS.md), and no step reads them."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        h = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(h)[..., :self.config.vocab_size], None
        return None, self.loss(h, self.lm_head.weight, targets)
