"""torch_impl.hf.rebind, the adapter's one rebinding of a forward's global functions: only names
the forward loads as globals, its decorators kept (transformers' `force_accelerate_hooks` still
fires), nothing global changed; and a model whose conv or chunked kernel transformers dispatches to
flash-linear-attention or causal-conv1d is refused naming the package."""

import functools
import sys
import types

import pytest
import torch

from parity_tests.hf import hf_models
from torch_impl.hf import chunked, kinds, rebind, recurrent


def double(x):
    return 2 * x


def counted(forward):
    @functools.wraps(forward)
    def wrapper(self, x):
        self.calls += 1
        return forward(self, x)

    return wrapper


class Doubling(torch.nn.Module):
    calls = 0

    @counted
    def forward(self, x):
        """Doubles x."""
        return double(x) + self.double(x)  # a global and an attribute of the same name

    def double(self, x):
        return x


def test_a_rebound_forward_keeps_its_decorators_and_changes_nothing_global():
    module = Doubling()
    new = rebind.rebind(Doubling.forward, {"double": lambda x: 3 * x})
    assert float(types.MethodType(new, module)(torch.tensor(1.0))) == 4.0  # 3 * 1 + 1: the global alone
    assert module.calls == 1  # the decorator ran
    for got, had in ((new, Doubling.forward), (new.__wrapped__, Doubling.forward.__wrapped__)):
        assert (got.__name__, got.__qualname__, got.__module__, got.__doc__) == (
            had.__name__,
            had.__qualname__,
            had.__module__,
            had.__doc__,
        )
    assert new.__wrapped__.__globals__["double"] is not double and globals()["double"] is double
    assert float(module(torch.tensor(1.0))) == 3.0  # the class's forward as it was
    with pytest.raises(ValueError, match=r"loads no global \['causal_conv1d_fn'\]"):
        rebind.rebind(Doubling.forward, {"causal_conv1d_fn": None})


def test_a_decorator_that_does_not_hold_its_function_is_refused():
    class Wrapper:  # a callable object: no closure to put the new function in
        def __init__(self, function):
            self.__wrapped__ = function

        def __call__(self, *args):
            return self.__wrapped__(*args)

    with pytest.raises(ValueError, match="does not hold the function it wraps"):
        rebind.rebind(Wrapper(Doubling.forward.__wrapped__), {"double": None})


def test_a_decorator_that_holds_its_function_elsewhere_too_is_refused():
    """A wrapper that could call the old function through something other than the cell rebind
    replaces (a list in its closure, a partial, its defaults, an attribute) is refused; the plain
    wrapper around the same function is not."""
    forward = Doubling.forward.__wrapped__

    def in_a_list(function):
        kept = [function]

        @functools.wraps(function)
        def wrapper(self, x):
            return kept[0](self, x) if self.calls else function(self, x)

        return wrapper

    def in_a_partial(function):
        later = functools.partial(function)

        @functools.wraps(function)
        def wrapper(self, x):
            return later(self, x) if self.calls else function(self, x)

        return wrapper

    def in_the_defaults(function):
        @functools.wraps(function)
        def wrapper(self, x, _old=function):
            return _old(self, x) if self.calls else function(self, x)

        return wrapper

    def in_an_attribute(function):
        wrapper = counted(function)
        wrapper.original = function
        return wrapper

    for decorator in (in_a_list, in_a_partial, in_the_defaults, in_an_attribute):
        with pytest.raises(ValueError, match="holds the function it wraps elsewhere"):
            rebind.rebind(decorator(forward), {"double": None})
    assert rebind.chain(counted(forward))[-1] is forward


def gated_deltanet():
    model = hf_models.build("qwen3_5", dtype=torch.float32)
    return next(m for m in model.modules() if recurrent.kernel_of(m) is not None)


def test_accelerate_hooks_still_fire_in_a_cp_forward():
    """Qwen3.5's Gated DeltaNet forward is decorated with transformers' `force_accelerate_hooks`
    ("conv1d"): made CP (here without a group: the model's own functions), it still fires the
    offload hook of its conv."""

    class Hook:
        calls = 0

        def pre_forward(self, module):
            Hook.calls += 1

        def post_forward(self, module, output):
            return output

    layer = gated_deltanet()
    x = torch.randn(1, 8, layer.hidden_size)
    expected = layer(x)
    recurrent.apply_recurrent(layer, None, "contiguous")
    layer.conv1d._hf_hook = Hook()
    assert torch.equal(layer(x), expected)
    assert Hook.calls == 1
    assert isinstance(layer.forward.__func__.__wrapped__.__globals__[recurrent.CONV], chunked.ConvHalo)


@pytest.mark.parametrize(
    "family,name,package,distribution",
    [
        ("qwen3_5", "chunk_gated_delta_rule", "fla", "flash-linear-attention"),
        ("lfm2", "causal_conv1d_fn", "causal_conv1d", "causal-conv1d"),
    ],
)
def test_a_kernel_package_behind_transformers_dispatcher_is_refused(
    monkeypatch, family, name, package, distribution
):
    """With the package installed, transformers' dispatcher runs its kernel, not the PyTorch function
    the CP versions are verified through: the walk refuses the layer, naming the package."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    model = hf_models.build(family, dtype=torch.float32)
    layer = next(m for m in model.modules() if recurrent.kernel_of(m) or recurrent.is_short_conv(m))
    scope = type(layer).forward.__wrapped__.__globals__
    global_name = next(g for g in recurrent._replaced(layer) if g.endswith(name))  # its own: torch_...
    assert rebind.kernel_package(scope[global_name]) is None  # no kernel package on this machine
    assert kinds._kind("layer", layer) in ("recurrent", "short_conv")

    installed = types.ModuleType(package)
    setattr(installed, name, lambda *args, **kwargs: None)
    monkeypatch.setitem(sys.modules, package, installed)
    torch_function = scope[global_name].__wrapped__
    dispatcher = use_kernel_func_from_hub_with_fallback(name, package)(torch_function)
    monkeypatch.setitem(scope, global_name, dispatcher)
    assert rebind.kernel_package(dispatcher) == distribution
    assert rebind.kernel_package(functools.wraps(dispatcher)(lambda *a: dispatcher(*a))) == distribution
    with pytest.raises(
        ValueError, match=f"calls `{global_name}`, which transformers dispatches to {distribution}"
    ):
        kinds._kind("layer", layer)
