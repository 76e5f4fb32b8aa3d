"""The peer data plane: weight buckets over TCP (and fd passing on one host), relayed generator to generator.

``store`` (buckets in sealed-size memfd mappings), ``server`` (streams a version's buckets to children),
``topology`` (who pulls from whom, decided in Redis), ``transport`` (:class:`PeerTransport`, the
``peer://`` scheme, registered in :mod:`async_rl.weights.transport`). Protocol and figures:
``docs/weights.md``, "Data plane and peer relay".
"""
