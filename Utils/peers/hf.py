"""Hugging Face transformers' GPT-2 (GPT2LMHeadModel with SDPA attention) as a peer: the model a user would
take off the shelf, trained by the suite's own loop with the recipe an informed user applies to it (TF32,
bf16 autocast, torch.compile, fused AdamW), so that only the model's code differs from the fused rung.

The step calls the model as HF's examples do, labels = the inputs (HF shifts them: T - 1 predictions per row
where the rungs make T), and keeps only the loss: the logits HF returns are written out whole, as every HF
user's compiled model writes them.
"""
import torch
import torch.nn as nn

from Utils.ladder.apply import Unavailable
from Utils.model_config import GPTConfig
from Utils.results.schema import PEER_PREFIX

NAME = PEER_PREFIX + "hf"
ADDITIONS = ("tf32", "bf16", "torch_compile", "fused")


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise Unavailable(f"transformers cannot be imported ({e}): pip install transformers") from None
    return transformers


def version() -> str:
    """The installed transformers' version, or '' where it is not installed."""
    try:
        return _transformers().__version__
    except Unavailable:
        return ""


class HFGPT2(nn.Module):
    """GPT2LMHeadModel behind the step's interface: forward(idx, targets) -> (logits, loss)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        t = _transformers()
        # GPT-2's shape, its tanh GELU ("gelu_new"), no dropout (as the rungs: the work per step is the same).
        hf_config = t.GPT2Config(vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd,
                                 n_layer=config.n_layer, n_head=config.n_head, activation_function="gelu_new",
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        hf_config._attn_implementation = "sdpa"
        self.hf = t.GPT2LMHeadModel(hf_config)
        self.hf.loss_type = "ForCausalLM"   # named, so that transformers does not warn that it guessed it
        self.config = config

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        out = self.hf(input_ids=idx, labels=idx if targets is not None else None)
        return out.logits, out.loss

    def num_params(self, exclude_position_embedding: bool = True) -> int:
        """Parameters counted once (the tied embedding once), as GPT.num_params counts them."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.hf.transformer.wpe.weight.numel() if exclude_position_embedding else n


def about() -> str:
    return f"transformers {version()} GPT2LMHeadModel, SDPA attention, labels = inputs (T - 1 predictions a row)"


def main(argv: list[str], command: str) -> int:
    """Parse the rung scripts' arguments, then run and record the peer; the exit status."""
    from Utils.train.run import Peer, main as run_main
    return run_main(ADDITIONS, argv, command, peer=Peer(NAME, HFGPT2, about))
