"""SEBPLinear: an nn.Linear whose backward skips inactive rows of dL/dY."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .config import SEBPConfig
from .density import RowDensity
from .functional import sebp_linear
from .registry import graph_key, name_module
from .sampling import SampleState


# Hook registries of nn.Module. The swapped-in module shares the very same dicts, so hooks registered before
# a swap keep firing after it, and their handles still remove them.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _take_over(new: nn.Module, old: nn.Module) -> None:
    """Give ``new`` the training mode, hooks and extra attributes (e.g. accelerate's ``_hf_hook``) of ``old``."""
    new.train(old.training)
    for name in _HOOK_DICTS:
        if hasattr(old, name):
            setattr(new, name, getattr(old, name))
    for key in ("_is_full_backward_hook", "_hf_hook"):
        if key in vars(old):
            setattr(new, key, vars(old)[key])
    for key, value in vars(old).items():
        if not key.startswith("_") and key not in vars(new) and key != "sebp_config":
            setattr(new, key, value)


def with_parameters_of(linear: nn.Linear, make: Callable[[], nn.Linear]) -> nn.Linear:
    """``make()``, built on the meta device (no memory), then given *the same* Parameter objects as ``linear``
    (state-dict keys and data pointers unchanged) and its mode and hooks."""
    with torch.device("meta"):
        new = make()
    new.weight = linear.weight
    new.bias = linear.bias
    _take_over(new, linear)
    return new


def plain_linear(linear: nn.Linear) -> nn.Linear:
    """A plain nn.Linear holding the same Parameters as ``linear``."""
    return with_parameters_of(linear, lambda: nn.Linear(linear.in_features, linear.out_features,
                                                         bias=linear.bias is not None))


class SEBPLinear(nn.Linear):
    """Drop-in nn.Linear with the SEBP backward. Build it with :meth:`from_linear` to share Parameters."""

    # set by sebp_probe.model.patch.patch_activations on the linears that read an SEBP activation's gradient
    _sebp_hint = None
    # set by sebp_probe.model.patch.patch_model: the model's PadRows (sebp_kernels.pad_rows)
    _sebp_pad_rows = None
    # set by that PadRows' check (or a resume restoring it): this layer's dY is far sparser, it selects its own
    # rows; public, so that an unpatch and a later patch of the same model keep it, as they keep the verdict
    sebp_own_rows = False
    _sebp_key_input = False  # the key as a tensor input of compiled graphs (sebp_kernels.registry.keys_as_inputs)

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, config=None, sample_key=0):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.sebp_config = config or SEBPConfig()
        self._sebp_density = RowDensity()  # picks the dense backward while nearly all rows are active
        self._sebp_sampler = SampleState(sample_key)  # sampled mode: cutoff, draw counter, counters
        name_module(self)  # names this layer inside compiled graphs (see sebp_kernels.registry)

    def __setstate__(self, state):  # copies (deepcopy, pickle) get a key of their own
        super().__setstate__(state)
        name_module(self)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: SEBPConfig | None = None, sample_key: int = 0) -> "SEBPLinear":
        """A SEBPLinear holding *the same* Parameter objects as ``linear`` (keys and data pointers unchanged).
        ``sample_key``: the layer's key in sampled mode's row hash (:func:`~.sampling.layer_key` of its name)."""
        if type(linear) is not nn.Linear and not isinstance(linear, SEBPLinear):
            raise TypeError(f"expected a plain nn.Linear, got {type(linear).__name__}")
        return with_parameters_of(linear, lambda: cls(linear.in_features, linear.out_features,
                                                      bias=linear.bias is not None, config=config,
                                                      sample_key=sample_key))

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear holding the same Parameters."""
        return plain_linear(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hint, pad, traced, rows, bound = self._sebp_hint, self._sebp_pad_rows, None, None, None
        if pad is not None and self.sebp_config.mode == "exact":
            if torch.compiler.is_compiling():
                traced = pad.traced()  # inputs of the graph, taken by its forward and backward operators
                bound = pad.row_bound
            else:
                hint = pad.bind(hint, x.shape, self)
                rows = pad.forward_rows(x.shape)  # the forward over the real-token rows alone, once checked
        state = self._sebp_sampler if self.sebp_config.mode == "sampled" else self._sebp_density
        return sebp_linear(x, self.weight, self.bias, self.sebp_config, state, hint,
                           _key=graph_key(self), _pad=traced, _rows=rows, _row_bound=bound)

    def extra_repr(self) -> str:
        c = self.sebp_config
        detail = {"exact": "", "threshold": f", eps={c.eps:g}", "topk": f", top_n={c.top_n}",
                  "sampled": f", budget={c.budget}{', sample_dx' if c.sample_dx else ''}"}[c.mode]
        return f"{super().extra_repr()}, mode={c.mode}{detail}"
