"""GPT-2 as in the paper and nanoGPT: learned position embeddings, pre-LayerNorm blocks, GELU (tanh),
a token embedding tied to the output layer, no dropout. The attention implementation is a config
field so that the ladder switches it without touching the model's mathematics."""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from Utils import bias_gemm, ce_kernel
from Utils.gelu_mlp import gelu_mlp
from Utils.packed_attention import packed_attention

ATTENTIONS = ("manual", "sdpa", "cudnn", "cudnn_packed")
LOSSES = ("full", "chunked", "chunked_kernel")
RESIDUALS = ("fp32", "autocast")
MLPS = ("modules", "epilogue")
BIAS_GRADS = ("sum", "gemm")
# The model options that a config names, and a recipe passes on to it: both check them here.
CHOICES = {"attention": ATTENTIONS, "loss": LOSSES, "residual": RESIDUALS, "mlp": MLPS, "bias_grad": BIAS_GRADS}


def check_choices(obj, choices=CHOICES):
    """Raise ValueError unless each field of obj named in choices holds one of its allowed values."""
    for name, allowed in choices.items():
        if getattr(obj, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {getattr(obj, name)!r}")


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    attention: str = "manual"   # "manual" materializes the T x T scores; "sdpa" calls F.scaled_dot_product_attention;
                                # "cudnn": the same call, restricted to cuDNN's fused attention kernels;
                                # "cudnn_packed": cuDNN's kernels on the packed QKV tensor and its gradient
                                # (Utils.packed_attention)
    vocab_multiple: int = 1     # embedding rows padded to a multiple of this; the padding never reaches the loss
    loss: str = "full"          # "full": logits then cross-entropy; "chunked": see chunked_cross_entropy;
                                # "chunked_kernel": the same, its softmax-gradient pass a hand-written
                                # kernel (Utils.ce_kernel)
    residual: str = "fp32"      # the residual stream's dtype under autocast: "fp32", or "autocast" (bf16
                                # autocast only)
    mlp: str = "modules"        # "modules": nn.Linear, nn.GELU, nn.Linear; "epilogue": c_fc's bias and GELU, and
                                # GELU's derivative, in GEMM epilogues (Utils.gelu_mlp)
    bias_grad: str = "sum"      # "sum": autograd sums each bias gradient over the tokens; "gemm": c_attn's and
                                # c_fc's come out of their weight-gradient GEMMs (Utils.bias_gemm)

    @property
    def padded_vocab_size(self):
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "vocab_multiple"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        check_choices(self)


# The GPT-2 sizes from the paper (Radford et al. 2019, table 2), and a tiny one for CPUs and tests.
PRESETS = {
    "tiny": GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=64),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.attention = config.attention
        self.bias_gemm = config.bias_grad == "gemm"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.residual_scale = True
        if self.attention == "manual":
            mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        qkv = bias_gemm.linear(x, self.c_attn) if self.bias_gemm else self.c_attn(x)
        if self.attention == "cudnn_packed":
            return self.c_proj(packed_attention(qkv, self.n_head))
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.attention == "cudnn":
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
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
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.residual_scale = True
        self.epilogue = config.mlp == "epilogue"
        self.bias_gemm = config.bias_grad == "gemm"

    def forward(self, x):
        if self.epilogue:
            return gelu_mlp(x, self.c_fc, self.c_proj, ones=self.bias_gemm)
        h = bias_gemm.linear(x, self.c_fc) if self.bias_gemm else self.c_fc(x)
        return self.c_proj(self.gelu(h))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
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
        self.apply(self._init_weights)
        if config.padded_vocab_size != config.vocab_size:
            # Padded after the init, so that every weight is drawn exactly as without padding. The extra rows
            # are zeros, are cut from the logits before the loss, and so never receive a gradient.
            wte = self.transformer.wte
            pad = wte.weight.new_zeros(config.padded_vocab_size - config.vocab_size, config.n_embd)
            wte.weight = nn.Parameter(torch.cat([wte.weight.detach(), pad]))
            wte.num_embeddings = self.lm_head.out_features = config.padded_vocab_size
            self.lm_head.weight = wte.weight

    def _init_weights(self, module):
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

    def num_params(self, exclude_position_embedding=True):
        """Parameters counted once (the tied embedding once, its padding rows not at all); without wpe for
        the FLOPs formula."""
        n = sum(p.numel() for p in self.parameters())
        n -= (self.config.padded_vocab_size - self.config.vocab_size) * self.config.n_embd   # padding is not model
        if exclude_position_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        if (self.config.residual == "autocast" and torch.is_autocast_enabled(idx.device.type)
                and torch.get_autocast_dtype(idx.device.type) == torch.bfloat16):
            # Autocast leaves the residual stream in the embeddings' fp32, since adding a bf16 block output
            # to it promotes; cast once here, and every add, LayerNorm read and their gradients move half
            # the bytes. The blocks' outputs are bf16 already: only the sum's rounding changes. bf16 only:
            # fp16's range could overflow a residual stream that has no loss scaling.
            x = x.to(torch.bfloat16)
        for block in self.transformer.h:
            x = block(x)
        h = self.transformer.ln_f(x)
        V = self.config.vocab_size
        if targets is not None and self.config.loss != "full":
            return None, chunked_cross_entropy(h.reshape(-1, h.size(-1)), self.lm_head.weight, targets.reshape(-1), V,
                                               kernel=self.config.loss == "chunked_kernel")
        logits = self.lm_head(h)[..., :V]   # a full slice, a no-op, unless the vocabulary is padded
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        return logits, loss


CHUNK_ROWS = 4096
KERNEL_ROW_MULTIPLE = 128


def kernel_logits_width(n_rows):
    """The width of the logits that the loss kernel gets for an output layer of n_rows: a multiple of 128."""
    return -(-n_rows // KERNEL_ROW_MULTIPLE) * KERNEL_ROW_MULTIPLE


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of h @ W.T against targets over the first vocab_size columns, CHUNK_ROWS tokens at
    a time.

    Each chunk's logits are made, reduced and turned into their gradient (softmax minus one-hot) at once,
    and the gradients with respect to h and W are accumulated in the forward pass: the B x T x V logits
    never exist whole, in fp32 or in bf16. The GEMMs use all of W's rows, padding included, so that a
    padded vocabulary keeps its aligned tiles; padded columns are masked out of the softmax, so their
    gradient is exactly zero. Backward only scales the stored gradients. With `kernel`, each chunk's
    softmax-gradient pass is Utils.ce_kernel's kernel, which writes the gradient over the logits."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size, kernel):
        device_type = h.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h.dtype
        acc = torch.promote_types(h.dtype, torch.float32)   # the softmax and the sums: fp32 at least
        w = weight.to(dtype)
        if kernel:
            # Logits rows a multiple of 128 wide keep the GEMMs that write and read them aligned and evenly
            # tiled where the vocabulary is not padded (Inductor pads the plain path's GEMM by itself, but
            # not a kernel's input); the extra columns are masked like the padding, their zero gradient
            # rows cut off below.
            w = F.pad(w, (0, 0, 0, kernel_logits_width(w.size(0)) - w.size(0)))
        n = h.size(0)
        loss = h.new_zeros((), dtype=acc)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(w.shape, dtype=acc, device=h.device)
        with torch.autocast(device_type, enabled=False):
            for i in range(0, n, CHUNK_ROWS):
                hc, tc = h[i:i + CHUNK_ROWS].to(dtype), targets[i:i + CHUNK_ROWS]
                if kernel:
                    grad = hc @ w.t()   # overwritten in place with its own gradient
                    loss = loss + ce_kernel.cross_entropy_grad(grad, tc, vocab_size).sum().to(acc)
                else:
                    chunk_loss, grad = softmax_grad(hc @ w.t(), tc, vocab_size, acc)
                    loss = loss + chunk_loss
                grad_h[i:i + CHUNK_ROWS] = (grad @ w).to(h.dtype)
                grad_w += (grad.t() @ hc).to(acc)
        ctx.save_for_backward(grad_h, grad_w[:weight.size(0)])
        ctx.n, ctx.weight_dtype = n, weight.dtype
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        return grad_h * scale, (grad_w * scale).to(ctx.weight_dtype), None, None, None


def softmax_grad(logits, targets, vocab_size, acc=torch.float32):
    """(sum of the rows' cross-entropy losses, softmax minus one-hot in logits' dtype) over the first
    vocab_size columns; later columns get a zero gradient. Written as reductions and elementwise maps of
    the logits, which a compiler fuses into one kernel over bf16 logits (Inductor's reads each row three
    times and writes the gradient once): no fp32 copy of the logits is written."""
    columns = torch.arange(logits.size(1), device=logits.device)
    x = logits.to(acc).masked_fill(columns >= vocab_size, float("-inf"))
    lse = torch.logsumexp(x, dim=-1)
    loss = (lse - x.gather(1, targets[:, None]).squeeze(1)).sum()
    one_hot = (columns == targets[:, None]).to(acc)
    return loss, (torch.exp(x - lse[:, None]) - one_hot).to(logits.dtype)


def chunked_cross_entropy(h, weight, targets, vocab_size, kernel=False):
    """Cross-entropy of the output layer without materializing the logits; equals
    F.cross_entropy((h @ weight[:vocab_size].T), targets) up to the rounding of the matmul dtype, and gives
    weight's rows from vocab_size on a zero gradient. kernel=True needs Utils.ce_kernel.available()."""
    return _ChunkedCrossEntropy.apply(h, weight, targets, vocab_size, kernel)
