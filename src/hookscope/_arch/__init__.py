"""What hookscope knows of model families, built on the hook core and below the shared machinery.

Canonical names (``std/``: family tables as data, a structural detector, the resolver), sample
inputs made from a model's config (``samples/``), what ``scaled_dot_product_attention`` holds
inside (``attention.py``, ``eager_advice.py``), and the site plan that expands ``std:`` names and
attention sub-sites into what the core attaches (``plan.py``). The core attaches hooks and never
learns a model family; this layer is its client.
"""
