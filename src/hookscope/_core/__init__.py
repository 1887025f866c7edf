"""The hook core: pick modules, attach hooks, always take them off, walk nested values.

Features (capture, trace, edit, ...) build on these four modules and on nothing private of
PyTorch's: ``select`` (selectors), ``attach`` (``HookGroup``, the only caller of
``register_*hook``), ``tree`` (tensors inside nested outputs) and ``sites`` (per-call numbering).
"""
