"""The ``math_verify`` reward: is the response's final answer mathematically equal to the reference answer?

Equality is judged by `math-verify <https://github.com/huggingface/Math-Verify>`_ (sympy underneath), on the forms
MATH-style data stores its answers in: bare LaTeX without ``$`` (``\\sqrt{2}``, ``3\\pi``, ``\\dfrac{3}{4}``,
``(-\\infty, 3]``, ``\\{1,2\\}``, ``\\text{(B)}``, ``90^\\circ``, ``\\$18.90``, ``10,\\!080``) or plain numbers
(``0.5``, ``-50``).

* **The reference** is parsed as LaTeX inside ``\\boxed{...}`` when it has neither a ``$`` (``\\$`` is a dollar
  sign) nor a ``\\boxed`` of its own: math-verify extracts LaTeX only from inside an environment (``$...$``,
  ``\\[...\\]``, ``\\boxed{}``), so a bare reference used to yield nothing (``\\pi``: every response scored 0) or a
  piece of itself (``3\\pi`` read as ``3``, ``(-\\infty, 3]`` as ``3``: a wrong response scored 1). A reference with
  ``$`` or ``\\boxed`` is parsed as written.
* **The response** is parsed as LaTeX, ``\\boxed{}`` first (math-verify's ``boxed_match_priority=0``), then after
  "final answer is" or "answer:", then any LaTeX, and as a plain expression (``x = 2``); the first kind of match
  found wins, the rightmost first.
* **A reference that parses to nothing** cannot be compared: every response to it scores 0 with the component
  ``unparsable_reference`` 1.0 (the learner's ``reward/unparsable_reference`` is the share of samples scored against
  such a reference), and the scorer logs it through a :class:`~async_rl.process.repeated.RepeatedLine`: at once for
  the first, then one summary line per 30 s, each naming the latest reference and its row.

Parsed references are cached (a prompt's samples share one parse). Known limit (math-verify's): a number's base
subscript is dropped, so ``204_5`` equals ``204_6``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from async_rl.process.repeated import RepeatedLine
from async_rl.tasks.base import Score

log = logging.getLogger(__name__)

MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own bound on parsing and comparing one answer (a SIGALRM: only on the main thread; elsewhere
unbounded)."""
MATH_DELIMITER = re.compile(r"(?<!\\)\$")
"""A ``$`` that opens or closes math (``\\$`` is a dollar sign: ``\\$18.90``)."""
NUM_CACHED_REFERENCES = 4096
"""Parsed references kept (least recently used dropped): more than the distinct answers in flight at once."""


def reference_text(answer: str) -> str:
    """What the reference is parsed from: ``answer`` itself when it has a ``$`` (not a ``\\$``) or ``\\boxed``,
    else ``answer`` in ``\\boxed{}`` (see the module docstring)."""
    return answer if MATH_DELIMITER.search(answer) or "\\boxed" in answer else f"\\boxed{{{answer}}}"


class MathVerifyReward:
    """Scores responses against reference answers (see the module docstring); one per task, not thread-safe."""

    unparsable: RepeatedLine
    """The log line of references that parse to nothing (counted once per reference, not per sample)."""
    _references: OrderedDict[str, list[Any]]
    """Reference answer -> what math-verify parsed from it (an empty list: nothing)."""
    _parse: Any
    _verify: Any
    _gold_config: list[Any]
    _response_config: list[Any]

    def __init__(self) -> None:
        try:
            from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        except ImportError as exc:
            raise ValueError("task.reward=math_verify needs the math-verify package: pip install 'async-rl[tasks]'") from exc
        self._parse, self._verify = parse, verify
        self._gold_config = [LatexExtractionConfig(boxed_match_priority=0)]
        self._response_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
        self._references = OrderedDict()
        self.unparsable = RepeatedLine(
            log, "math_verify: {n} reference answer(s) parse to nothing, latest {answer!r} (row {row}): responses to "
                 "them score 0, counted as reward/unparsable_reference", level=logging.WARNING)  # fmt: skip

    def reference(self, answer: str, metadata: Mapping[str, Any] | None = None) -> list[Any]:
        """What math-verify parses from reference ``answer`` (cached; an empty list: nothing, logged once)."""
        gold = self._references.get(answer)
        if gold is not None:
            self._references.move_to_end(answer)
            return gold
        gold = list(self._parse(reference_text(answer), extraction_config=self._gold_config,
                                parsing_timeout=_timeout()))  # fmt: skip
        self._references[answer] = gold
        if len(self._references) > NUM_CACHED_REFERENCES:
            self._references.popitem(last=False)
        if not gold:
            self.unparsable.add(answer=answer, row=(metadata or {}).get("row", "?"))
        return gold

    def __call__(self, response: str, answer: str, metadata: Mapping[str, Any] | None = None) -> Score:
        """1.0 when the response's answer equals ``answer``, else 0.0; components ``correct`` and
        ``unparsable_reference``."""
        gold = self.reference(answer, metadata)
        if not gold:
            return Score(reward=0.0, info={"correct": 0.0, "unparsable_reference": 1.0})
        timeout = _timeout()
        pred = self._parse(response, extraction_config=self._response_config, parsing_timeout=timeout)
        ok = bool(pred) and bool(self._verify(gold, pred, timeout_seconds=timeout))
        return Score(reward=float(ok), info={"correct": float(ok), "unparsable_reference": 0.0})


    def answer(self, response: str) -> str | None:
        """The response's final answer as math-verify reads it, as its sympy form prints (equal values print alike:
        ``\\frac{1}{2}`` and ``0.5`` both ``1/2``); None when it reads nothing."""
        pred = self._parse(response, extraction_config=self._response_config, parsing_timeout=_timeout())
        if not pred:
            return None
        import sympy

        expr = pred[0]
        if isinstance(expr, sympy.Expr) and expr.atoms(sympy.Float):  # 0.5 as 1/2
            expr = sympy.nsimplify(expr, rational=True)
        return str(expr)


def _timeout() -> int | None:
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
