"""Peers: the trainers a user would pick instead of the suite, run at the same batch and sequence length on the
same GPU and recorded beside the rungs, as optimization peer-<name> (`make peers`).

  llmc  Karpathy's llm.c (CUDA C++), built from source at a pinned commit: Utils.peers.llmc
  hf    Hugging Face transformers' GPT-2 under the suite's loop and the fused rung's recipe: Utils.peers.hf

A peer that cannot be built or imported here is recorded as skipped, with what to provide.
"""
PEERS = ("llmc", "hf")
