"""Tensor parallelism: how the weights split across ranks (`shard.py`) and the process group
the ranks talk over (`group.py`, torch.distributed: gloo on the CPU, NCCL on CUDA)."""
