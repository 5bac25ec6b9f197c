"""SEBPLinear: an nn.Linear whose backward skips inactive rows of dL/dY."""
from __future__ import annotations

import torch
from torch import nn

from .config import SEBPConfig
from .functional import sebp_linear


class SEBPLinear(nn.Linear):
    """Drop-in nn.Linear with the SEBP backward. Build it with :meth:`from_linear` to share Parameters."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, config=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.sebp_config = config or SEBPConfig()

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: SEBPConfig | None = None) -> "SEBPLinear":
        """A SEBPLinear holding *the same* Parameter objects as ``linear`` (keys and data pointers unchanged)."""
        if type(linear) is not nn.Linear and not isinstance(linear, SEBPLinear):
            raise TypeError(f"expected a plain nn.Linear, got {type(linear).__name__}")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        for name, hook_dict in (("_forward_hooks", linear._forward_hooks),
                                ("_forward_pre_hooks", linear._forward_pre_hooks)):
            getattr(new, name).update(hook_dict)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear holding the same Parameters."""
        with torch.device("meta"):
            lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        lin.weight = self.weight
        lin.bias = self.bias
        lin.train(self.training)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sebp_linear(x, self.weight, self.bias, self.sebp_config)

    def extra_repr(self) -> str:
        c = self.sebp_config
        detail = {"exact": "", "threshold": f", eps={c.eps:g}", "topk": f", top_n={c.top_n}"}[c.mode]
        return f"{super().extra_repr()}, mode={c.mode}{detail}"
