"""The adapter's one rebinding: a module's forward run with some of the global functions it calls
replaced (torch_impl.hf.recurrent's causal convs and chunked kernels; TRL's GRPO and RLOO methods
that call accelerate's module-level gathers, torch_impl.hf.rl.rebound), and what stands behind
those functions in transformers.

transformers has no substitution point for them: its kernel dispatchers
(`use_kernel_func_from_hub_with_fallback`) pick their implementation once, when the model's module
is imported, and its hub kernels (`use_kernelized_func`, `kernelize`) replace whole layers. So the
forward's own code runs over a copy of its module's globals in which the replaced names are the CP
versions; nothing global changes. Guarded:
- each replaced name must be one the forward loads as a global (its bytecode's LOAD_GLOBAL; an
  attribute `self.causal_conv1d_fn` of the same name is not one);
- every decorator of the forward (a `functools.wraps` wrapper holding the function it wraps in its
  closure, as transformers' `force_accelerate_hooks`) is kept around the new function, and each
  function keeps its `__name__`, `__qualname__`, `__module__`, `__doc__` and `__wrapped__`;
- a decorator that holds the function it wraps anywhere else too (its defaults, its attributes, or
  inside what its closure holds: a list, a dict, a partial, another function's closure) is
  refused, as it could call the old function there. Only what the wrapper itself holds is searched
  (not its module's globals, nor the attributes of objects it holds).
"""

import dis
import functools
import inspect
import types

# the packages transformers' dispatchers run in place of their PyTorch functions, by distribution
DISTRIBUTIONS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}


def global_loads(function) -> frozenset:
    """The global names `function`'s innermost code loads (LOAD_GLOBAL, its nested code's too),
    under its decorators."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return _loads(code) if code is not None else frozenset()


@functools.cache
def _loads(code) -> frozenset:
    """The globals `code` loads, and the code nested in it (comprehensions, lambdas, inner
    functions: they read the same globals)."""
    nested = (const for const in code.co_consts if isinstance(const, types.CodeType))
    own = frozenset(i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL")
    return own.union(*(_loads(inner) for inner in nested))


def kernel_package(function) -> str | None:
    """The package (its distribution's name) whose kernel `function`, a transformers kernel
    dispatcher (or a function wrapping one), calls in place of its own PyTorch function because
    the package is installed; None where it calls the PyTorch function, or dispatches nothing."""
    while isinstance(function, types.FunctionType) and hasattr(function, "__wrapped__"):
        try:
            found = inspect.getclosurevars(function).nonlocals
        except ValueError:  # an empty cell: a wrapper still being built, not a dispatcher
            found = {}
        if found.get("is_new_implementation"):
            package = found.get("package")
            return DISTRIBUTIONS.get(package, package or "an installed package")
        function = function.__wrapped__
    return None


def _holds(cell, function) -> bool:
    return any(held is function for held in _contents(cell))


def _copy(function, scope, closure):
    new = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__, closure)
    new.__kwdefaults__ = function.__kwdefaults__
    new.__dict__.update(function.__dict__)  # functools.wraps' attributes, __wrapped__ set by the caller
    new.__module__, new.__qualname__, new.__doc__ = (
        function.__module__,
        function.__qualname__,
        function.__doc__,
    )
    new.__annotations__ = dict(function.__annotations__)
    return new


def _parts(held) -> tuple:
    """What a container, cell, partial, bound method or function (its closure, defaults and
    attributes; not its globals) holds."""
    if isinstance(held, (tuple, list, set, frozenset)):
        return tuple(held)
    if isinstance(held, dict):
        return (*held, *held.values())
    if isinstance(held, types.CellType):
        return _contents(held)
    if isinstance(held, functools.partial):
        return (held.func, held.args, held.keywords)
    if isinstance(held, types.MethodType):
        return (held.__func__,)
    if isinstance(held, types.FunctionType):
        return (held.__closure__ or (), held.__defaults__ or (), held.__kwdefaults__ or {}, held.__dict__)
    return ()


def _contents(cell) -> tuple:
    try:
        return (cell.cell_contents,)
    except ValueError:  # an empty cell
        return ()


def _reaches(held, function) -> bool:
    """Whether `function` is among what `held` holds, searched through _parts."""
    stack, seen = [held], set()
    while stack:
        item = stack.pop()
        if item is function:
            return True
        if id(item) not in seen:
            seen.add(id(item))
            stack.extend(_parts(item))
    return False


def _holds_only_in_cells(outer, inner) -> bool:
    """Whether `outer` holds `inner` in a closure cell of its own and nowhere else (but its
    `__wrapped__`), so that a copy of `outer` with those cells replaced calls only the new one."""
    cells = outer.__closure__ or ()
    others = [cell for cell in cells if not _holds(cell, inner)]
    attributes = {name: value for name, value in outer.__dict__.items() if name != "__wrapped__"}
    return len(others) < len(cells) and not any(
        _reaches(held, inner) for held in (*others, outer.__defaults__, outer.__kwdefaults__, attributes)
    )


def chain(function) -> list:
    """`function`, the function each of its decorators wraps, ..., the innermost; ValueError where a
    decorator is not a function holding the one it wraps in its closure, or holds it elsewhere too
    (rebind could not keep it)."""
    found = [function]
    while hasattr(found[-1], "__wrapped__"):
        outer, inner = found[-1], found[-1].__wrapped__
        if not isinstance(outer, types.FunctionType) or not any(
            _holds(cell, inner) for cell in outer.__closure__ or ()
        ):
            raise ValueError(
                f"its forward's decorator {outer!r} does not hold the function it wraps in a closure"
            )
        if not _holds_only_in_cells(outer, inner):
            raise ValueError(
                f"its forward's decorator {outer!r} holds the function it wraps elsewhere than in its "
                "closure's cells too (its defaults, attributes, or inside what it holds): a rebound "
                "copy could still call the old function"
            )
        found.append(inner)
    if not isinstance(found[-1], types.FunctionType):
        raise ValueError(f"its forward {found[-1]!r} is not a Python function")
    return found


def rebind(function, replacements: dict):
    """A copy of `function` (a forward, decorated or not) whose innermost code sees `replacements`
    (global name -> object) in place of its module's globals of those names; its decorators kept.
    ValueError (before anything is made) for a name the code does not load as a global."""
    functions = chain(function)
    inner = functions[-1]
    missing = sorted(set(replacements) - global_loads(inner))
    if missing:
        raise ValueError(f"its forward {inner.__qualname__} loads no global {missing}")
    # the module's globals but its __name__: torch.compile reads a named scope's globals from the
    # module of that name (where the CP functions are not), an unnamed one from this dict
    scope = {name: value for name, value in inner.__globals__.items() if name != "__name__"}
    scope.update(replacements)
    old, new = inner, _copy(inner, scope, inner.__closure__)
    for wrapper in reversed(functions[:-1]):
        closure = tuple(types.CellType(new) if _holds(cell, old) else cell for cell in wrapper.__closure__)
        wrapped, old = new, wrapper
        new = _copy(wrapper, wrapper.__globals__, closure)
        new.__wrapped__ = wrapped
    return new
