"""Whether a model isolates packed documents in one process: the rule CP must follow.

transformers isolates the documents of a packed row (position_ids restarting, no attention_mask, no
cache) only where the model hands its mask functions (`create_causal_mask`, ...) the position_ids:
Llama, Mistral, Gemma, LFM2, DeepSeek V3.2 and GLM-5 do; GPT-OSS (and Bloom, Falcon, MPT, ...) do
not, and in one process their tokens attend across documents. A rank cannot tell from its own mask
call (transformers looks for restarts in the rank's own positions, which a shard inside one document
does not have), and every rank must decide alike (the decision picks each layer's transport), so it
is read once from the source of the module that receives the inputs (its forward and the methods
it defines, BERT's `_create_attention_masks` for instance), the same on every rank: its calls of
transformers' mask functions, with their keyword arguments and the `**kwargs` dicts they expand
(`mask_kwargs = {...}`, copies and item assignments of it).
"""

import ast
import functools
import inspect
import logging
import textwrap

MASK_FUNCTIONS = {
    "create_causal_mask",
    "create_sliding_window_causal_mask",
    "create_chunked_causal_mask",
    "create_masks_for_generate",
}
log = logging.getLogger("torch_impl.hf")


@functools.cache
def isolates_documents(model_class):
    """True when every mask function call in `model_class`'s methods (its own and those it inherits
    from transformers' modeling classes) receives position_ids, False when none does; None when it
    makes no such call or cannot be read (packed rows are then refused)."""
    try:
        sources = [
            textwrap.dedent(inspect.getsource(cls))
            for cls in model_class.__mro__
            if cls.__module__.startswith("transformers.models.") or cls is model_class
        ]
        tree = ast.Module([node for source in sources for node in ast.parse(source).body], [])
    except (OSError, TypeError, SyntaxError):
        return None
    aliases, keys = set(MASK_FUNCTIONS), {}  # names bound to mask functions; dict name -> its keys
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if isinstance(value, ast.Dict):
                keys[name] = {k.value for k in value.keys if isinstance(k, ast.Constant)}
            elif _is_copy(value):
                keys[name] = set(keys.get(_copied(value), ()))
            elif {n.id for n in ast.walk(value) if isinstance(n, ast.Name)} & MASK_FUNCTIONS:
                aliases.add(name)  # e.g. `mask_function = create_causal_mask if ... else ...`
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            target = node.targets[0]
            if isinstance(target.value, ast.Name) and isinstance(target.slice, ast.Constant):
                keys.setdefault(target.value.id, set()).add(target.slice.value)
    passed = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) in aliases:
            names = {k.arg for k in node.keywords if k.arg}
            for k in node.keywords:
                if k.arg is None and isinstance(k.value, ast.Name):
                    names |= keys.get(k.value.id, set())
            passed.append("position_ids" in names)
    if not passed:
        return None
    if len(set(passed)) > 1:
        log.info("%s passes position_ids to some of its mask functions only", model_class.__name__)
    return any(passed)


def _name(func):
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _is_copy(value):
    """`d.copy()` or `dict(d)`."""
    return isinstance(value, ast.Call) and (
        (isinstance(value.func, ast.Attribute) and value.func.attr == "copy")
        or (_name(value.func) == "dict" and len(value.args) == 1)
    )


def _copied(value):
    source = value.func.value if isinstance(value.func, ast.Attribute) else value.args[0]
    return source.id if isinstance(source, ast.Name) else None
