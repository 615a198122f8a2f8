"""The model's configuration (GPTConfig: its shape, the padding of its vocabulary, and its one implementation
switch) and the GPT-2 presets. Plain data, no torch: the report (Utils.report.roofline) reads the sizes it
computes floors from here, where the model reads them, without importing the model."""
from dataclasses import dataclass


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    flash: bool = False        # F.scaled_dot_product_attention instead of the T x T scores written out
    vocab_multiple: int = 1    # embedding rows padded to a multiple of this; the padding never reaches the loss

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "vocab_multiple"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if not isinstance(self.flash, bool):
            raise ValueError(f"flash={self.flash!r} must be True or False")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")


# The GPT-2 sizes from the paper (Radford et al. 2019, table 2), and a tiny one for CPUs and tests.
PRESETS = {
    "tiny": GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=64),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
}
