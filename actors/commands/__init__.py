"""The commands: the top floor, which assembles processes (the ``async-rl`` dispatcher, ``quickstart``,
``status``, ``bench ...``) and may import anything below it (``actors/``, ``buffer/``, ``async_rl/``);
nothing below imports it.

May import: anything.
"""
