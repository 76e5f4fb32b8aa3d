"""Building the nested config dataclasses every component owns, from TOML files, dicts and ``a.b=c`` overrides.

``configurable`` (parsing, validation, unknown keys refused with "did you mean") and ``keys`` (every key of a
config read from the dataclasses themselves: ``--help-keys``). The configs themselves live beside their components.

May import: nothing of async_rl.
"""
