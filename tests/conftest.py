import torch

# Tiny models run fastest on one thread, and two threads on two busy cores can be many times slower.
torch.set_num_threads(1)
