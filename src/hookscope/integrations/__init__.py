"""Integrations with training frameworks; each module imports its framework only when used.

- :mod:`hookscope.integrations.hf`: ``HookscopeCallback`` for the transformers ``Trainer``;
- :mod:`hookscope.integrations.lightning`: ``HookscopeCallback`` for a Lightning ``Trainer``.
"""
