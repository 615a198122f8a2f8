"""Hand-written kernels, one module each, under one contract:

- `unavailable(device)`: None where the kernel runs on that device, else one line saying why not;
- the op: a PyTorch operator or autograd Function that torch.compile and CUDA graphs can take;
- `reference`: the same mathematics in plain PyTorch, which the tests compare the op against.

The ops: gemm_bias_grad, gelu_epilogue, fp8_linear, packed_attention, loss_kernel, chunked_loss, fp8_loss. The
libraries some of them call: cublaslt (cuBLASLt's GEMM epilogues) and nvrtc (CUDA C++ compiled at run
time), both through native, the one loader of native libraries.

Nothing here imports the rest of Utils: the ladder (Utils.ladder) swaps these ops into the model.
"""
