"""The benchmark prompts: a chat answer, a code completion, a summary that repeats its input."""

BENCH_PROMPTS = {
    "chat": "Explain in a few sentences why the sky is blue.",
    "code": "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "summary": (
        "Summarize this text in two sentences, reusing its wording: "
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
        "It is named after the engineer Gustave Eiffel, whose company designed and built the "
        "tower from 1887 to 1889. It was the entrance arch of the 1889 World's Fair."
    ),
}
# A prompt whose drafts (n-gram lookups) essentially never match: the 0.95x floor check.
NO_MATCH_PROMPT = "Count from one to twenty in French words, one per line, nothing else."
