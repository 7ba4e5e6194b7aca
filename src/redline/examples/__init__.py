"""The built-in example workloads: ``example:digits`` and ``example:chargpt``."""
