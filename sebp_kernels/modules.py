"""SEBPLinear: an nn.Linear whose backward skips inactive rows of dL/dY; SEBPConv1D: the same over a weight
stored transposed, as transformers' ``Conv1D`` (GPT-2) keeps it."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .config import SEBPConfig
from .density import RowDensity
from .functional import linear_for_layer
from .registry import graph_key, name_module
from .sampling import SampleState


# Hook registries of nn.Module. The swapped-in module shares the very same dicts, so hooks registered before
# a swap keep firing after it, and their handles still remove them.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _take_over(new: nn.Module, old: nn.Module, skip: tuple[str, ...] = ("sebp_config",)) -> None:
    """Give ``new`` the training mode, hooks and extra attributes (e.g. accelerate's ``_hf_hook``) of ``old``,
    but those named in ``skip``."""
    new.train(old.training)
    for name in _HOOK_DICTS:
        if hasattr(old, name):
            setattr(new, name, getattr(old, name))
    for key in ("_is_full_backward_hook", "_hf_hook"):
        if key in vars(old):
            setattr(new, key, vars(old)[key])
    for key, value in vars(old).items():
        if not key.startswith("_") and key not in vars(new) and key not in skip:
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

    def kernel_weight(self) -> torch.Tensor:
        """The weight as ``F.linear`` takes it, (out, in)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hint, pad, traced, rows, bound, fwd = self._sebp_hint, self._sebp_pad_rows, None, None, None, True
        if pad is not None and self.sebp_config.mode == "exact":
            if torch.compiler.is_compiling():
                traced = pad.traced()  # inputs of the graph, taken by its forward and backward operators
                bound, fwd = pad.row_bound, pad.forward_real_rows
            else:
                hint = pad.bind(hint, x.shape, self)
                rows = pad.forward_rows(x.shape)  # the forward over the real-token rows alone, once checked
        state = self._sebp_sampler if self.sebp_config.mode == "sampled" else self._sebp_density
        return linear_for_layer(x, self.kernel_weight(), self.bias, self.sebp_config, state, hint,
                                key=graph_key(self), pad=traced, rows=rows, row_bound=bound, forward_rows=fwd)

    def extra_repr(self) -> str:
        c = self.sebp_config
        detail = {"exact": "", "threshold": f", eps={c.eps:g}", "topk": f", top_n={c.top_n}",
                  "sampled": f", budget={c.budget}{', sample_dx' if c.sample_dx else ''}"}[c.mode]
        return f"{super().extra_repr()}, mode={c.mode}{detail}"


class SEBPConv1D(SEBPLinear):
    """:class:`SEBPLinear` over a weight stored (in, out), ``y = x @ W + b``: the layout of transformers'
    ``Conv1D`` (GPT-2's attention and MLP). The kernels get the transposed view ``Wᵀ`` (out, in; no copy in the
    forward; the backward's kernels read it strided where they can), so the SEBP gradients are those of the
    SEBP linear; autograd hands dW back transposed to the (in, out) Parameter. Build it with
    :meth:`from_conv1d`, which shares the module's Parameters; :meth:`to_linear` gives that module back."""

    @classmethod
    def from_conv1d(cls, conv: nn.Module, config: SEBPConfig | None = None, sample_key: int = 0) -> "SEBPConv1D":
        """An SEBPConv1D holding *the same* Parameter objects as ``conv`` (keys and data pointers unchanged):
        any module whose ``weight`` is (in, out) and ``bias`` None or (out,), applied as ``x @ weight + bias``
        (the caller vouches for that; sebp_kernels knows no transformers class)."""
        w, b = getattr(conv, "weight", None), getattr(conv, "bias", None)
        if isinstance(conv, SEBPLinear) or not isinstance(w, nn.Parameter) or w.dim() != 2 or (
                b is not None and tuple(b.shape) != (w.shape[1],)):
            raise TypeError(f"expected a Conv1D-like module (weight (in, out), bias (out,)), got "
                            f"{type(conv).__name__}")
        new = with_parameters_of(conv, lambda: cls(w.shape[0], w.shape[1], bias=b is not None, config=config,
                                                   sample_key=sample_key))
        new.__dict__["_sebp_plain"] = conv  # not a submodule: no state_dict key, not in named_modules
        return new

    def kernel_weight(self) -> torch.Tensor:
        """The weight as ``F.linear`` takes it: the (out, in) view of the stored (in, out) one."""
        return self.weight.t()

    def to_linear(self) -> nn.Module:
        """The module this was built from, holding this one's Parameters, mode and hooks."""
        plain = self.__dict__["_sebp_plain"]
        plain.weight, plain.bias = self.weight, self.bias
        _take_over(plain, self, skip=("sebp_config", "in_features", "out_features"))
        return plain
