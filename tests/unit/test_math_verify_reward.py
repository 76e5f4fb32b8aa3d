"""The ``math_verify`` reward on the answers MATH-style data stores: bare LaTeX (radicals, pi, infinity, intervals,
sets, text and multiple-choice answers, degrees, dollars, thousands separators, matrices), fractions, decimals and
negative numbers. A response boxing the same answer scores 1, an equivalent form scores 1, a wrong one 0; a
reference that parses to nothing is said once and counted, not scored 0 in silence."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from async_rl.tasks import TaskConfig, build_task
from async_rl.tasks.math_verify_reward import MathVerifyReward, reference_text

pytest.importorskip("math_verify")

# (reference as MATH stores it, an equivalent response, a wrong response). The references are answer strings of
# MATH's test split (Hendrycks et al. 2021), verbatim, except the last two rows, which are the issue's own
# examples (`\infty`, `\{1,2\}`) that the split stores only inside larger answers.
CASES = [
    (r"\sqrt{51}", r"\boxed{\sqrt{51}}", r"\boxed{51}"),
    (r"3\sqrt{13}", r"\boxed{\sqrt{117}}", r"\boxed{3}"),
    (r"2\sqrt{5}", r"\boxed{\sqrt{20}}", r"\boxed{2}"),
    (r"11\sqrt2", r"\boxed{11\sqrt{2}}", r"\boxed{11}"),
    (r"\frac{\sqrt{3}}{3}", r"\boxed{\frac{1}{\sqrt{3}}}", r"\boxed{\sqrt{3}}"),
    (r"\frac{3\sqrt{3}}{4}", r"\boxed{\frac{3}{4}\sqrt{3}}", r"\boxed{\frac{3}{4}}"),
    (r"1 \pm \sqrt{19}", r"\boxed{1+\sqrt{19}, 1-\sqrt{19}}", r"\boxed{1 + \sqrt{19}}"),
    (r"\pi", r"\boxed{\pi}", r"\boxed{3.14}"),
    (r"12\pi", r"\boxed{12 \pi}", r"\boxed{12}"),
    (r"18+2\pi", r"\boxed{2\pi + 18}", r"\boxed{20}"),
    (r"-\frac{\pi}{6}", r"\boxed{-\dfrac{\pi}{6}}", r"\boxed{\frac{\pi}{6}}"),
    (r"\frac{20000}{\pi}", r"\boxed{\dfrac{20000}{\pi}}", r"\boxed{20000}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3, \frac{\pi}{2})}", r"\boxed{(3, \pi)}"),
    (r"(-\infty, 2) \cup (3, \infty)", r"\boxed{(-\infty,2)\cup(3,\infty)}", r"\boxed{(-\infty, 2] \cup [3, \infty)}"),
    (r"(5,\infty)", r"\boxed{(5, \infty)}", r"\boxed{[5, \infty)}"),
    (r"(-\infty, 0]", r"\boxed{(-\infty,0]}", r"\boxed{(-\infty, 0)}"),
    (r"\left(\frac{3}{5},\frac{8}{3}\right]", r"\boxed{(0.6, \frac{8}{3}]}", r"\boxed{[\frac{3}{5}, \frac{8}{3}]}"),
    (r"x \in [-2,7]", r"\boxed{[-2,7]}", r"\boxed{[-2,8]}"),
    (r"\{1\pm\sqrt{5},-2\}", r"\boxed{\{-2, 1+\sqrt{5}, 1-\sqrt{5}\}}", r"\boxed{\{1+\sqrt{5}, -2\}}"),
    (r"-2,1", r"\boxed{1, -2}", r"\boxed{-2, 2}"),
    (r"\text{(B)}", r"\boxed{B}", r"\boxed{\text{(C)}}"),
    (r"\text{(E)}", r"\boxed{\text{(E)}}", r"\boxed{(D)}"),
    (r"\text{Evelyn}", r"\boxed{Evelyn}", r"\boxed{\text{Briana}}"),
    (r"\text{ellipse}", r"\boxed{\text{ellipse}}", r"\boxed{\text{parabola}}"),
    (r"\frac{14}{3}", r"\boxed{\frac{28}{6}}", r"\boxed{\frac{3}{14}}"),
    (r"\dfrac{17}{50}", r"\boxed{0.34}", r"\boxed{0.35}"),
    (r"\frac 34", r"\boxed{\frac{3}{4}}", r"\boxed{34}"),
    (r"\frac9{19}", r"\boxed{\frac{9}{19}}", r"\boxed{\frac{19}{9}}"),
    (r"1\frac{4}{5}", r"\boxed{\frac{9}{5}}", r"\boxed{\frac{4}{5}}"),
    (r"137 \frac{1}{2}", r"\boxed{137.5}", r"\boxed{68.5}"),
    ("1.25", r"\boxed{\frac{5}{4}}", r"\boxed{1.24}"),
    (".35625", r"\boxed{0.35625}", r"\boxed{0.3562}"),
    ("-50", r"\boxed{-50}", r"\boxed{50}"),
    (r"-\frac{35}{9}", r"\boxed{-\frac{35}{9}}", r"\boxed{\frac{35}{9}}"),
    (r"-\sqrt{3}", r"\boxed{-\sqrt{3}}", r"\boxed{\sqrt{3}}"),
    (r"90^\circ", r"\boxed{90}", r"\boxed{45^\circ}"),
    (r"145^\circ", r"\boxed{145^{\circ}}", r"\boxed{135^\circ}"),
    (r"\frac{270}7\text{ degrees}", r"\boxed{\frac{270}{7}}", r"\boxed{\frac{7}{270}}"),
    (r"\$18.90", r"\boxed{\$18.9}", r"\boxed{\$19}"),
    (r"\$32,\!348", r"\boxed{32348}", r"\boxed{32}"),
    (r"10,\!080", r"\boxed{10080}", r"\boxed{10}"),
    ("58,500", r"\boxed{58500}", r"\boxed{58}"),
    (r"864 \mbox{ inches}^2", r"\boxed{864}", r"\boxed{865}"),
    (r"6 - 5i", r"\boxed{6-5i}", r"\boxed{6+5i}"),
    (r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}",
     r"\boxed{\begin{pmatrix} -\frac{1}{3} \\ \frac{2}{3} \\ \frac{5}{3} \end{pmatrix}}",
     r"\boxed{\begin{pmatrix} 1/3 \\ 2/3 \\ 5/3 \end{pmatrix}}"),
    (r"x^3+3x-6", r"\boxed{x^3 + 3x - 6}", r"\boxed{x^3+3x+6}"),
    (r"p - q", r"\boxed{-q + p}", r"\boxed{q - p}"),
    (r"y = 2x + 3", r"\boxed{y=2x+3}", r"\boxed{y = 2x - 3}"),
    (r"\cot x", r"\boxed{\frac{\cos x}{\sin x}}", r"\boxed{\tan x}"),
    (r"\infty", r"\boxed{\infty}", r"\boxed{-\infty}"),
    (r"\{1,2\}", r"\boxed{\{2,1\}}", r"\boxed{\{1,3\}}"),
]


def test_math_answers_score_right() -> None:
    reward = MathVerifyReward()
    wrong = []
    for reference, equivalent, other in CASES:
        got = {
            "same": reward(f"So the answer is $\\boxed{{{reference}}}$.", reference).reward,
            "equivalent": reward(f"Thus {equivalent}.", reference).reward,
            "wrong": reward(f"Thus {other}.", reference).reward,
        }
        if got != {"same": 1.0, "equivalent": 1.0, "wrong": 0.0}:
            wrong.append(f"{reference!r}: {got}")
    assert len(CASES) >= 50 and not wrong, "\n".join(wrong)
    assert reward.unparsable.total == 0


def test_the_bare_reference_is_boxed_for_the_parser() -> None:
    # Unwrapped, math-verify read `3\pi` as 3 and `(-\infty, 3]` as 3 (a wrong answer scored 1), `\sqrt{2}` as nothing.
    assert reference_text(r"3\pi") == r"\boxed{3\pi}" and reference_text("0.5") == r"\boxed{0.5}"
    assert reference_text(r"$\frac{1}{2}$") == r"$\frac{1}{2}$" and reference_text(r"\boxed{2}") == r"\boxed{2}"
    reward = MathVerifyReward()
    assert reward(r"\boxed{3}", r"3\pi").reward == 0.0 and reward(r"\boxed{3}", r"(-\infty, 3]").reward == 0.0
    assert reward(r"\boxed{\sqrt{2}}", r"\sqrt{2}").info == {"correct": 1.0, "unparsable_reference": 0.0}
    # The response's \boxed{} wins over other answers it mentions; plain text answers still parse.
    assert reward(r"First I thought $x = 4$, but the final answer is \boxed{2}", "2").reward == 1.0
    assert reward("x = 2", "2").reward == 1.0 and reward("0.25", "0.5").reward == 0.0


def test_an_unparsable_reference_is_said_once_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from async_rl.model.byte_tokenizer import build_byte_tokenizer

    path = tmp_path / "math.jsonl"
    rows = [{"id": "bad", "prompt": "?", "answer": ""}, {"id": "good", "prompt": "1/2?", "answer": r"\dfrac{1}{2}"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_byte_tokenizer()
    tok.save_pretrained(str(tmp_path / "tok"))
    task = build_task(TaskConfig(name="jsonl", jsonl_path=str(path), tokenizer=str(tmp_path / "tok"), reward="math_verify",
                                 shuffle=False))  # fmt: skip
    bad, good = task.prompt(0).metadata, task.prompt(1).metadata
    response = tok(r"so \boxed{0.5}", add_special_tokens=False).input_ids
    with caplog.at_level(logging.WARNING, logger="async_rl.tasks.math_verify_reward"):
        scores = [task.score(bad, response) for _ in range(8)]  # a prompt's group of 8 samples
        assert task.score(good, response).info == {"correct": 1.0, "unparsable_reference": 0.0}
    assert all(s.reward == 0.0 and s.info == {"correct": 0.0, "unparsable_reference": 1.0} for s in scores)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "parse to nothing, latest '' (row bad)" in lines[0], lines
    assert "reward/unparsable_reference" in lines[0]
