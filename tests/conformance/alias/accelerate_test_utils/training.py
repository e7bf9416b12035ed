"""A noisy line y = a*x + b to fit, and the two-parameter model that fits it."""

import numpy as np
import torch


class RegressionDataset:
    """`length` points of y = a*x + b plus N(0, 0.1) noise, drawn from numpy's generator for `seed`."""

    def __init__(self, a=2, b=3, length=64, seed=None):
        draw = np.random.default_rng(seed)
        self.length = length
        self.x = draw.normal(size=(length,)).astype(np.float32)
        noise = draw.normal(scale=0.1, size=(length,)).astype(np.float32)
        self.y = a * self.x + b + noise

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return {"x": self.x[index], "y": self.y[index]}


class RegressionModel(torch.nn.Module):
    """y = a*x + b with `a` and `b` as parameters; says its dtypes on the first batch."""

    def __init__(self, a=0, b=0, double_output=False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())
        self.first_batch = True

    def forward(self, x=None):
        if self.first_batch:
            print(f"Model dtype: {self.a.dtype}, {self.b.dtype}. Input dtype: {x.dtype}")
            self.first_batch = False
        return x * self.a + self.b
