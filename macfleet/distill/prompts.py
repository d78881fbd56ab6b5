"""Prompts for self-distillation, from sources that need no download.

The head must predict what THIS verifier says to ordinary requests, so training data is the
verifier's own answers to many varied prompts. Five offline sources, mixed round-robin:

* `chat`: everyday requests (advice, how things work, descriptions, messages to rewrite or
  write, comparisons, recommendations; macfleet/distill/chat_prompts.py);
* `topics`: questions over a list of topics in many phrasings (chat, explanation, advice);
* `code`: programming tasks in several languages and styles;
* `local`: instructions over text already on this machine (explain a stdlib function's code,
  summarize or rewrite a docstring or a README paragraph);
* `problems`: word problems with varied numbers;
* `self`: questions the verifier wrote itself (macfleet/distill/self_instruct.py), when a
  dataset holds them.

`HELD_OUT` are the benchmark's prompts: they, anything equal to them and any near-copy of
them (contamination.NEAR_COPY) are never trained on (`iter_prompts` drops them), so
`macfleet bench drafter` measures unseen requests.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import itertools
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from macfleet.distill.chat_prompts import chat_prompts
from macfleet.distill.contamination import PromptIndex
from macfleet.engine.conversation import Turn

# The benchmark's held-out requests (what a new user types), by kind. Never trained on, and no
# training prompt is a near-copy of one (contamination.NEAR_COPY; tests/distill/
# test_contamination.py checks every template family and the committed dataset's questions). A
# request is a text, or a conversation (a tuple of Turns: earlier turns, then the user's last).
HELD_OUT: dict[str, str | tuple[Turn, ...]] = {
    "chat": "What should I pack for a weekend camping trip in the mountains?",
    "code": "Write a Python function that merges two sorted lists into one sorted list.",
    "explain": "Explain how a refrigerator keeps food cold.",
    "rewrite": "Rewrite this recipe step so a beginner can follow it: Cream the butter and "
               "sugar, fold in the flour, then bake blind for 15 minutes.",
    "problem": "A shop sells pencils at 3 for $1. How much do 27 pencils cost? Explain.",
    "describe": "Describe a busy market on a Saturday morning.",
    "followup": (
        Turn("user", "My sourdough starter smells like nail polish remover. Is it ruined?"),
        Turn("assistant", "No, it is just hungry. That sharp smell comes from the yeast and "
                          "bacteria running out of food. Pour off most of it, feed it fresh "
                          "flour and water, and the smell should fade within a day or two."),
        Turn("user", "How often should I feed it if I keep it on the kitchen counter?")),
    "paragraph": "Read this paragraph and answer the question after it.\n\n"
                 "The island ferry leaves the north harbour every 40 minutes from 6:20 a.m. "
                 "until 9:40 p.m. On Sundays the first crossing is at 8:00 a.m. and the "
                 "ferry runs once an hour. Bicycles travel free, cars pay 12 euros each way, "
                 "and foot passengers pay 3 euros, or 1.50 euros with a student card. The "
                 "crossing takes 25 minutes.\n\n"
                 "Question: I am a student and want to bring my bike on the first Sunday "
                 "ferry. When do I arrive on the island, and how much do I pay?",
}
# Why the set is what it is: the prompts that changed, and why (`bench drafter` records it)
HELD_OUT_CHANGES: dict[str, str] = {
    "rewrite": "replaced (issue 35): the old prompt, 'Rewrite this sentence to sound more "
               "formal: hey, can u send me the report by tomorrow? thanks!', had 37 "
               "near-copies (difflib ratio > 0.8, best 0.87) among the 7.6M dataset's "
               "training prompts, all from the chat_prompts.REWRITE template family (3,627, "
               "best 0.90, among every prompt that family can write), and its greedy "
               "answer's first 24 tokens were verbatim in the answer store; measured at "
               "2.06x, it lifted the recorded geomean from about 1.46x to 1.55x. The new one "
               "(nearest training prompt 0.47; none of its greedy answer's 8-grams in the "
               "store) asks for a real rewrite no template family writes",
    "followup": "added (issue 35): a multi-turn follow-up (an earlier answer in the context), "
                "a kind the data factory never writes",
    "paragraph": "added (issue 35): a question about a pasted paragraph, answered from it, "
                 "a kind the data factory never writes",
}
# Their subjects: a question the verifier writes itself (self_instruct) that names one is dropped
HELD_OUT_SUBJECTS = ("camping", "refrigerator", "fridge", "market", "pencil", "sorted list",
                     "sourdough", "ferry", "bake blind")
CHAT_KINDS = ("chat", "explain", "rewrite", "problem", "describe", "followup", "paragraph")
CODE_KINDS = ("code",)


def prompt_text(prompt: str | tuple[Turn, ...]) -> str:
    """A request as one text (a conversation's turns joined by blank lines): what keys and
    near-copy checks compare."""
    return prompt if isinstance(prompt, str) else "\n\n".join(t.content for t in prompt)


def user_texts(prompt: str | tuple[Turn, ...]) -> tuple[str, ...]:
    """What a user typed in a request: the text, or every user turn of a conversation (and
    the whole conversation): a training prompt near any of them is a near-copy."""
    if isinstance(prompt, str):
        return (prompt,)
    return (*(t.content for t in prompt if t.role == "user"), prompt_text(prompt))


def prompt_kind(key: str) -> str:
    """"code" or "chat" for a key of HELD_OUT or UNSEEN (unseen code requests are "code:...")."""
    return "code" if key in CODE_KINDS or key.startswith("code:") else "chat"

TOPICS = (
    "black holes", "photosynthesis", "the water cycle", "volcanoes", "earthquakes", "DNA",
    "vaccines", "the immune system", "climate change", "renewable energy", "solar panels",
    "electric cars", "the internet", "encryption", "machine learning", "neural networks",
    "databases", "operating systems", "compilers", "cloud computing", "smartphones",
    "the Roman Empire", "the French Revolution", "the Industrial Revolution", "World War I",
    "ancient Egypt", "the Renaissance", "the printing press", "the Silk Road", "democracy",
    "inflation", "interest rates", "the stock market", "budgeting", "saving for retirement",
    "credit scores", "starting a small business", "marketing", "job interviews", "resumes",
    "time management", "public speaking", "learning a new language", "studying for exams",
    "sleep", "exercise", "meditation", "healthy eating", "vitamins", "hydration", "stress",
    "coffee", "tea", "baking bread", "making pasta", "grilling vegetables", "chocolate",
    "gardening", "composting", "houseplants", "dogs", "cats", "birds", "bees", "whales",
    "sharks", "rainforests", "deserts", "coral reefs", "the Moon", "Mars", "the Sun",
    "gravity", "magnetism", "electricity", "light", "sound", "atoms", "chemical reactions",
    "the periodic table", "evolution", "dinosaurs", "the human brain", "the heart",
    "music theory", "playing the guitar", "painting", "photography", "writing a novel",
    "poetry", "chess", "football", "basketball", "running a marathon", "cycling", "swimming",
    "hiking", "traveling on a budget", "Japan", "Italy", "Brazil", "Egypt", "Canada",
    "recycling", "plastic pollution", "air pollution", "electric grids", "nuclear power",
    "wind turbines", "batteries", "3D printing", "robots", "drones", "video games",
    "social media", "online privacy", "passwords", "email etiquette", "remote work",
    "teamwork", "leadership", "negotiation", "friendship", "parenting", "moving to a new city",
    "renting an apartment", "buying a used car", "home repairs", "cleaning a kitchen",
    "the scientific method", "statistics", "probability", "prime numbers", "fractions",
    "geometry", "algebra", "calculus", "logic puzzles", "philosophy", "ethics", "happiness",
    "museums", "libraries", "movies", "theater", "the Olympic Games", "weather forecasts",
    "hurricanes", "snow", "rainbows", "tides", "maps", "GPS", "airplanes", "trains", "ships",
)
TOPIC_TEMPLATES = (
    "What is {t}?", "Explain {t} in simple terms.", "Give me three interesting facts about {t}.",
    "How does {t} work?", "Why is {t} important?", "Write a short paragraph about {t}.",
    "What are the pros and cons of {t}?", "What are common misconceptions about {t}?",
    "Give a beginner's guide to {t}.", "Write a short poem about {t}.",
    "Explain {t} to a ten-year-old.", "What is the history of {t}?",
    "List five questions people often ask about {t}, with short answers.",
    "Write a short story that involves {t}.", "What should everyone know about {t}?",
    "Give me some tips related to {t}.", "Summarize the main ideas of {t} in a few sentences.",
    "How has {t} changed over time?", "Compare {t} and {u}.", "What do {t} and {u} have in common?",
)

CODE_TASKS = (
    "reverses a string", "checks whether a string is a palindrome", "returns the n-th prime",
    "computes the factorial of a number", "counts the vowels in a string",
    "finds the largest element of a list", "removes duplicates from a list",
    "sorts a list of numbers with bubble sort", "implements binary search",
    "computes the greatest common divisor of two numbers", "converts Celsius to Fahrenheit",
    "checks whether a year is a leap year", "returns the Fibonacci sequence up to n",
    "counts word frequencies in a text", "flattens a nested list", "transposes a matrix",
    "reads a file and counts its lines", "validates an email address",
    "finds the second largest number in a list", "computes the average of a list",
    "checks whether two strings are anagrams", "capitalizes every word in a sentence",
    "converts a decimal number to binary", "sums the digits of a number",
    "finds the intersection of two lists", "rotates a list by k positions",
    "computes the power set of a set", "implements a stack", "implements a queue",
    "implements a linked list", "parses a CSV line", "returns the median of a list",
    "checks whether a number is a perfect square", "generates a random password",
    "computes the area of a circle", "finds all divisors of a number",
    "merges two dictionaries", "groups words by their first letter",
    "counts the occurrences of each character", "checks balanced parentheses",
    "implements quicksort", "implements merge sort", "computes the dot product of two vectors",
    "finds the longest word in a sentence", "removes whitespace from a string",
    "converts a string to title case", "computes compound interest",
    "returns the minimum and maximum of a list", "checks whether a list is sorted",
    "splits a list into chunks of size n", "finds the mode of a list",
    "computes the Levenshtein distance between two strings", "implements a simple calculator",
    "converts Roman numerals to integers", "formats a number with thousands separators",
    "retries a function call up to three times", "memoizes a function",
    "measures how long a function takes", "walks a directory and lists all files",
)
LANGUAGES = ("Python", "Python", "Python", "JavaScript", "C", "Rust", "Go", "Java", "Bash")
CODE_TEMPLATES = (
    "Write a {lang} function that {task}.", "Show me how to write a {lang} function that {task}.",
    "Write a {lang} function that {task}, with comments.",
    "Explain how to write a {lang} function that {task}, with an example.",
    "Write a {lang} program that {task} and prints the result.",
    "Write a {lang} function that {task}, and a short test for it.",
)

PROBLEM_TEMPLATES = (
    "A train travels {a} miles in {b} hours. What is its average speed? Explain.",
    "If a shirt costs ${a} and is on sale for {p}% off, what is the sale price?",
    "Tom has {a} apples and gives {c} to his friend. How many does he have left?",
    "A recipe needs {c} eggs for {b} people. How many eggs are needed for {a} people?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "Sara saves ${c} every week. How many weeks does she need to save ${a}?",
    "A car uses {b} liters of fuel per 100 km. How much fuel does it need for {a} km?",
    "There are {a} students and each bus holds {c}. How many buses are needed?",
    "What is {p}% of {a}? Show the steps.",
    "If {b} workers build a wall in {c} days, how long do {a} workers take?",
)

LOCAL_TEMPLATES_CODE = (
    "Explain what this Python function does:\n\n```python\n{x}\n```",
    "Review this Python code and suggest improvements:\n\n```python\n{x}\n```",
    "Add comments to this Python function:\n\n```python\n{x}\n```",
)
LOCAL_TEMPLATES_TEXT = (
    "Summarize the following text in a few sentences:\n\n{x}",
    "Rewrite the following text in simpler words:\n\n{x}",
    "What are the key points of this text?\n\n{x}",
)
MAX_LOCAL_CHARS = 900


@dataclass(frozen=True)
class Prompt:
    source: str  # chat | topics | code | local | problems
    text: str
    # prompts made from the same material (a topic, a code task, a problem template, a file):
    # held-out figures hold out whole groups, so no held-out answer shares its material with
    # a trained one
    group: str = ""
    # a conversation (earlier turns before the user's last) when the request is one; `text`
    # is then its prompt_text. Encoded instead of `text` (batchgen)
    turns: tuple[Turn, ...] = ()

    @property
    def chat_input(self) -> str | tuple[Turn, ...]:
        return self.turns or self.text

    @classmethod
    def of(cls, source: str, prompt: str | tuple[Turn, ...], group: str = "") -> Prompt:
        """A Prompt for a text or a conversation."""
        if isinstance(prompt, str):
            return cls(source, prompt, group)
        return cls(source, prompt_text(prompt), group, tuple(prompt))

    @property
    def key(self) -> str:
        """Deduplication key: a hash of the normalised text."""
        return hashlib.sha1(" ".join(self.text.lower().split()).encode()).hexdigest()[:16]


# More unseen requests, for scoring draft heads on text no template produced (`bench heads`,
# `bench tree-shapes`): ordinary chat and code requests; no training prompt is a near-copy of
# one (tests/distill/test_contamination.py checks every set in `UNSEEN_SETS`).
UNSEEN: dict[str, str] = {
    "chat:green-tea": "My green tea always tastes bitter. What am I doing wrong when I brew it?",
    "chat:sleep": "What are some tips for sleeping better at night?",
    "chat:email": "Write a short email to a colleague asking to move our meeting to Friday.",
    "chat:sky": "Why is the sky blue?",
    "chat:rainy-day": "Plan an indoor scavenger hunt for two kids, aged seven and nine, on a "
                      "rainy afternoon.",
    "code:bank": "Write a Python class for a simple bank account with deposit and withdraw "
                 "methods.",
    "code:js-dedupe": "Write a JavaScript function that removes repeated words from a sentence, "
                      "keeping the first of each.",
    "code:with": "What does Python's with statement do when I open a file? Show a short example.",
    "chat:romeo": "Summarize the plot of Romeo and Juliet in a few sentences.",
    "chat:heating": "My electricity bill doubled this winter. What should I check first?",
}
_SEEN = ("replaced (issue 45): a near-copy of a training prompt (difflib ratio > 0.8 at "
         "contamination.NEAR_COPY)")
# The unseen requests that changed, and why: figures `bench heads` and `bench tree-shapes`
# recorded before on the old ones were measured on seen prompts (results/*.json say so)
UNSEEN_CHANGES: dict[str, str] = {
    "chat:tea": f"{_SEEN}: 'How do I make a good cup of tea?' 0.84 to the dataset question "
                "'how to make a cup of tea?'; now chat:green-tea",
    "chat:party": f"{_SEEN}: 'Give me three ideas for a birthday party for a ten year old.' "
                  "0.81 to chat:advice's 'give me some tips for a birthday party for a "
                  "six-year-old.'; now chat:rainy-day",
    "code:js-max": f"{_SEEN}: 'Write a JavaScript function that returns the largest number in "
                   "an array.' 0.83 to a code template's 'write a javascript function that "
                   "finds the second largest number in a list.', and 56% of its answer's "
                   "8-grams in one answer of the store; now code:js-dedupe",
    "code:tuple": f"{_SEEN}: 'What is the difference between a list and a tuple in Python?' "
                  "verbatim (1.00) among the dataset's questions; now code:with",
    "chat:groceries": f"{_SEEN}: 'How can I save money on groceries?' 0.81 to chat:advice's "
                      "'how can i save money on a job interview?'; now chat:heating",
}
# Every prompt set a benchmark calls held out or unseen: none may have a training prompt
# above contamination.NEAR_COPY (tests/distill/test_contamination.py)
UNSEEN_SETS: dict[str, dict] = {"HELD_OUT": HELD_OUT, "UNSEEN": UNSEEN}
HELD_OUT_KEYS = frozenset(Prompt.of("held", t).key
                          for t in (*HELD_OUT.values(), *UNSEEN.values()))


@functools.cache
def held_out_index():
    """The held-out and unseen requests (every user turn, and each whole) as a
    contamination.PromptIndex: a training prompt near-copying one (`near_copy_of`) is never
    trained on (iter_prompts, self_instruct.parse_list drop it)."""
    return PromptIndex((t, key) for key, p in (*HELD_OUT.items(), *UNSEEN.items())
                       for t in user_texts(p))


def topic_prompts(rng: random.Random) -> Iterator[Prompt]:
    pairs = [(t, tpl) for t in TOPICS for tpl in TOPIC_TEMPLATES]
    rng.shuffle(pairs)
    for t, tpl in pairs:
        yield Prompt("topics", tpl.format(t=t, u=rng.choice(TOPICS)), f"topic:{t}")


def code_prompts(rng: random.Random) -> Iterator[Prompt]:
    combos = list(itertools.product(CODE_TASKS, sorted(set(LANGUAGES)), CODE_TEMPLATES))
    rng.shuffle(combos)
    for task, lang, tpl in combos:
        yield Prompt("code", tpl.format(task=task, lang=lang), f"code:{task}")


def problem_prompts(rng: random.Random) -> Iterator[Prompt]:
    while True:
        i = rng.randrange(len(PROBLEM_TEMPLATES))
        tpl = PROBLEM_TEMPLATES[i]
        yield Prompt("problems", tpl.format(a=rng.randint(12, 480), b=rng.randint(2, 9),
                                            c=rng.randint(2, 11), p=rng.choice((10, 15, 20,
                                                                                25, 30, 40))),
                     f"problem:{i}")


def _functions(path: Path) -> Iterator[tuple[str, str | None]]:
    """(source, docstring) of top-level functions and methods of a Python file."""
    try:
        src = path.read_text(encoding="utf-8", errors="ignore")
        tree = ast.parse(src)
    except (OSError, SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            seg = ast.get_source_segment(src, node)
            if seg:
                yield inspect.cleandoc(seg) if seg.startswith(" ") else seg, \
                    ast.get_docstring(node)


def local_prompts(rng: random.Random, roots: tuple[Path, ...] | None = None) -> Iterator[Prompt]:
    """Instructions over the stdlib's own functions and docstrings and installed READMEs."""
    if roots is None:
        paths = sysconfig.get_paths()
        roots = (Path(paths["stdlib"]), Path(paths["purelib"]))
    files = sorted(roots[0].glob("*.py")) + sorted(roots[0].glob("*/*.py"))
    mds = [f for r in roots[1:] for f in sorted(r.glob("*/*.md")) + sorted(r.glob("*/README*"))]
    rng.shuffle(files)
    rng.shuffle(mds)
    for f in files:
        for seg, doc in _functions(f):
            if 150 <= len(seg) <= MAX_LOCAL_CHARS:
                yield Prompt("local", rng.choice(LOCAL_TEMPLATES_CODE).format(x=seg),
                             f"file:{f.name}")
            if doc and 200 <= len(doc) <= MAX_LOCAL_CHARS:
                yield Prompt("local", rng.choice(LOCAL_TEMPLATES_TEXT).format(x=doc),
                             f"file:{f.name}")
    for f in mds:
        try:
            text = f.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        for para in text.split("\n\n"):
            para = para.strip()
            if 250 <= len(para) <= MAX_LOCAL_CHARS and not para.startswith(("```", "|", "<")):
                yield Prompt("local", rng.choice(LOCAL_TEMPLATES_TEXT).format(x=para),
                             f"file:{f.parent.name}/{f.name}")


SOURCES = ("self", "chat", "topics", "code", "local", "problems")
DEFAULT_MIX = {"self": 8, "chat": 6, "topics": 5, "code": 4, "local": 1, "problems": 1}


def everyday_prompts(rng: random.Random) -> Iterator[Prompt]:
    for text, group in chat_prompts(rng):
        yield Prompt("chat", text, group)


def question_prompts(questions: Sequence[Prompt], seed: int = 0) -> Iterator[Prompt]:
    """The `self` source: the verifier's own questions (self_instruct.read_questions) in a
    deterministic shuffled order."""
    qs = list(questions)
    random.Random(seed).shuffle(qs)
    yield from qs


def iter_prompts(seed: int = 0, mix: dict[str, int] | None = None,
                 skip: frozenset[str] = frozenset(),
                 extra: Sequence[Prompt] = ()) -> Iterator[Prompt]:
    """Prompts from every source, interleaved by `mix` weights, deduplicated, held-out and
    `skip` keys (already generated: resume) dropped. `extra`: the verifier's own questions
    (source `self`; self_instruct.read_questions). Deterministic for a seed."""
    rng = random.Random(seed)
    mix = mix or DEFAULT_MIX
    gens = {"topics": topic_prompts(random.Random(rng.random())),
            "code": code_prompts(random.Random(rng.random())),
            "local": local_prompts(random.Random(rng.random())),
            "problems": problem_prompts(random.Random(rng.random()))}
    gens["chat"] = everyday_prompts(random.Random(rng.random()))  # drawn last: the other
    # sources keep the order they had before it existed
    gens["self"] = question_prompts(extra, seed)
    live = {s: gens[s] for s in SOURCES if mix.get(s, 0) > 0}
    seen = set(skip) | set(HELD_OUT_KEYS)
    held = held_out_index()
    while live:
        for s in list(live):
            for _ in range(mix[s]):
                p = next(live[s], None)
                if p is None:
                    live.pop(s)
                    break
                if p.key not in seen:
                    seen.add(p.key)
                    if held.near_copy_of(p.text) is None:
                        yield p
