"""Hand-written kernels, one module each, under one contract:

- `unavailable(device)`: None where the kernel runs on that device, else one line saying why not;
- the op: a PyTorch operator, autograd Function or optimizer that torch.compile and CUDA graphs can take;
- `reference`: the same mathematics in plain PyTorch, which the tests compare the op against.

Nothing here imports the rest of Utils: the ladder (Utils.ladder) swaps these ops into the model.
"""
