"""What the modules of torch_impl.hf share: the registered implementation's name, the kwarg that
carries packed documents, and reading a forward's arguments by name in hooks."""

import inspect

IMPLEMENTATION = "cp_transport"
INDEXED = "indexed_attention"  # DeepSeek Sparse Attention (DeepSeek V3.2, GLM-5): MLA + an indexer's top-k
DOCUMENTS = "cp_documents"  # the kwarg that carries packed sequences' document ids to the attention


class Arguments:
    """A forward's arguments by name, whether passed by position or keyword, for forward pre-hooks."""

    def __init__(self, forward):
        self.names = list(inspect.signature(forward).parameters)

    def get(self, args, kwargs, name):
        i = self.names.index(name) if name in self.names else len(args)
        return args[i] if i < len(args) else kwargs.get(name)

    def replace(self, args, kwargs, **values):
        """(args, kwargs) with the named arguments set to new values, where they were passed."""
        args, kwargs = list(args), dict(kwargs)
        for name, value in values.items():
            i = self.names.index(name)
            if i < len(args):
                args[i] = value
            else:
                kwargs[name] = value
        return tuple(args), kwargs
