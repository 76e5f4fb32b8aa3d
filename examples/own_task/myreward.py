"""The reward of the "bring your own task" example (docs/tasks.md): reverse a string of digits.

A reward is ``fn(text, metadata) -> float | {"reward": float, ...}``: ``text`` is the decoded response (cut at the
end token), ``metadata`` the prompt's row without its prompt (``answer``, ``id`` as ``row``, any other field). The
extra keys of a mapping are logged as ``reward/<key>`` beside the reward.
"""


def reverse_reward(text: str, metadata: dict) -> dict:
    answer = str(metadata["answer"])
    got = text.strip()
    right = sum(a == b for a, b in zip(got, answer, strict=False))  # digits in the right place
    return {
        "reward": right / max(len(answer), len(got), 1),
        "exact": float(got == answer),
    }
