"""The model a run trains, and the facts every process must agree on about it.

``config`` (:class:`ModelConfig`, torch-free), ``presets`` (random-init presets built offline, loading of local
Hugging Face directories and their tokenizers), ``moe`` (which layers are MoE, experts, top-k, the route dtype),
``hf_routes`` (recording and replaying the expert routes of a transformers MoE: the torch side of R3),
``architecture`` (what a generator's model must share with the learner's, checked at join), the offline
tokenizers (``toy_tokenizer`` for the toy tasks, ``byte_tokenizer`` for text) and ``token_mask`` (token ids a
response may never contain).

May import: nothing of async_rl.
"""
