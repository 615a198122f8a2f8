"""Hand-written kernels, one module each, under one contract:

- `unavailable(device)`: None where the kernel runs on that device, else one line saying why not;
- the op: a PyTorch operator or autograd Function that torch.compile and CUDA graphs can take;
- `reference`: the same mathematics in plain PyTorch, which the tests compare the op against.

The ops: gemm_bias_grad, gelu_epilogue, fp8_linear, norm_fold, packed_attention, loss_kernel, chunked_loss,
fp8_loss, recompute_logits (fp8_loss's chunks without stored logits). The libraries some of them call: native (the
one loader of native libraries, and CUDA C++ compiled at run time by NVRTC), cublaslt (cuBLASLt's GEMM epilogues) and
fp8 (the FP8 dtypes and casts).

Nothing here imports the rest of Utils, and a module imports at most two floors of the others (a module that
imports none is floor 0; tests/test_kernel_floors.py): the ladder (Utils.ladder) composes these ops into
layers (Utils.ladder.linear) and swaps them into the model.
"""
