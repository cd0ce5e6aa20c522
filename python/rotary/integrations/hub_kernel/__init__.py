"""rotary's local kernel repository for the ``kernels`` package: its
``layers`` are rotary.integrations.hub's (one definition, imported)."""

from rotary.integrations.hub import layers  # noqa: F401
