"""What a compiled step keeps for its backward pass (bench/saved_tensors.py), on the CPU: the fused rung keeps
the whole bf16 logits, which is its peak memory's largest activation at GPT-2's vocabulary (6.1 GiB at batch
64 x 1024 tokens, BENCHMARKS.md); the chunked loss keeps no tensor of a token's logits."""
import os
import sys

import torch

from conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
from saved_tensors import saved_by_step  # noqa: E402

from Utils.ladder.registry import RUNGS  # noqa: E402

VOCAB = 50257
BATCH, SEQ = 3, 32   # 96 tokens: no other dimension of the tiny model is 96


def test_the_fused_rung_keeps_the_bf16_logits_for_the_losss_backward():
    saved = saved_by_step(RUNGS["fused"].additions, "tiny", BATCH, SEQ, torch.device("cpu"))
    shape, dtype, nbytes = saved[0]
    assert (shape, dtype, nbytes) == ((BATCH * SEQ, VOCAB), torch.bfloat16, BATCH * SEQ * VOCAB * 2)


def test_the_chunked_loss_keeps_no_logits():
    saved = saved_by_step(RUNGS["fused"].additions + ("loss",), "tiny", BATCH, SEQ, torch.device("cpu"))
    assert not [s for s, _, _ in saved if VOCAB in s and BATCH * SEQ in s], saved[:3]
    # All it keeps besides the output layer's bf16 weight, [vocabulary, width], is a small part of the logits.
    assert sum(n for s, _, n in saved if s[0] != VOCAB) < BATCH * SEQ * VOCAB * 2 / 10
