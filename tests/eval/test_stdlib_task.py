"""stdlib_task.py: stdlib-mc's questions, built from the standard library's functions."""

from llama_ddp.eval.stdlib_task import build_questions

DOCS = [
    "import os\n\ndef f(a, b):\n    x = a\n    y = b\n    return x + y\n",
    "class C:\n    def g(self):\n        self.a = 1\n        self.b = 2\n        self.c = 3\n",
    "def h():\n    p = 1\n    q = 2\n    r = 3\n    for i in p:\n        print(i)\n\n"
    "def short():\n    return 0\n",
    "def k(z):\n    if z:\n        z += 1\n        return z\n    w = 4\n",
]


def test_stdlib_questions_continue_functions_against_other_files_lines():
    questions = build_questions(DOCS, seed=3)
    assert questions == build_questions(DOCS, seed=3)  # a pure function of the sources
    by_context = {q[0]: q for q in questions}
    # One question per function with three body lines after its def; none for `short`.
    assert set(by_context) == {
        "def f(a, b):\n    x = a\n    y = b",
        "    def g(self):\n        self.a = 1\n        self.b = 2",
        "def h():\n    p = 1\n    q = 2",
        "def k(z):\n    if z:\n        z += 1",
    }
    answers = {"return x + y", "self.c = 3", "r = 3", "return z"}
    for context, choices, label in questions:
        assert len(choices) == 4 and len(set(choices)) == 4
        assert choices[label].strip() in answers
        own = next(d for d in DOCS if d.startswith(context) or f"\n{context}\n" in d)
        length = len(choices[label])
        for wrong in choices[:label] + choices[label + 1 :]:
            assert abs(len(wrong) - length) <= max(2, length // 5)  # length gives nothing away
            assert wrong not in own.splitlines()  # drawn from other files
