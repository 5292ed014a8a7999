#!/usr/bin/env python3
# Reference trajectories from PyTorch's own optimizers (float64) for test_torch_reference.
# Prints one line per optimizer: its name, then the weights after 10 steps. Exit code 77 when
# torch is not installed (the test then skips). SPDX-License-Identifier: Apache-2.0
import math
import sys

try:
    import torch
except ImportError:
    sys.exit(77)

N, STEPS = 64, 10


def weights():
    return [math.sin(0.37 * i + 0.1) for i in range(N)]


def grad(t):
    return [math.cos(0.11 * i * (t + 1) + 0.5 * t) for i in range(N)]


CASES = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                          weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                                         weight_decay=0.05),
}

for name, make in CASES.items():
    w = torch.tensor(weights(), dtype=torch.float64, requires_grad=True)
    opt = make([w])
    for t in range(STEPS):
        w.grad = torch.tensor(grad(t), dtype=torch.float64)
        opt.step()
    print(name, " ".join(repr(float(x)) for x in w.detach()))
