"""The hook core: pick modules, plan sites, attach hooks, always take them off, walk nested values.

It works on any ``nn.Module`` and knows no model family (that is ``_arch``, above it). Features
build on ``select`` (selectors), ``plan`` (``SitePlan`` and ``attach_plan``, the one
transactional attach), ``attach`` (``HookGroup``, the only caller of ``register_*hook``),
``sites`` (the site grammar), ``tracker`` (per-call numbering), ``ops`` (op sites) and ``tree``
(tensors inside nested outputs); every private torch API it needs is read in ``compat/private``.
"""
