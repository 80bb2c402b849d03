"""The prompt set ``mechserve train-draft`` trains an EAGLE head on: shipped here, no downloads.

Varied on purpose, so that the head learns the model's own continuations across the kinds of text the
spec-decode workloads hold: open-ended writing, chat (one and several turns), code, summaries and
explanations.  ``conversations(seed)`` builds every conversation from the templates below, in an order
shuffled by ``seed``; ``prompt_set_hash`` names the set (written into the head's config).
"""

from __future__ import annotations

import hashlib
import json
import random

TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "the first day of spring in a mountain village",
    "a robot learning to paint",
    "a city where it never stops raining",
    "an old map found in a library book",
    "a friendship between a fox and a crow",
    "the last train of the night",
    "a garden on the roof of a hospital",
    "a detective who cannot remember faces",
    "a baker who bakes bread for the whole town",
    "a ship caught in a storm",
    "a child who can talk to trees",
    "the day the internet stopped working",
    "a musician who lost her hearing",
    "a journey across a desert",
    "a small bookshop that is about to close",
    "an astronaut looking back at Earth",
    "a family reunion after many years",
    "a clock that runs backwards",
    "the secret life of a cat",
    "a winter festival by a frozen lake",
    "a teacher on her last day before retirement",
    "a dragon who is afraid of fire",
    "a village that forgets everything each night",
)
SUBJECTS = (
    "photosynthesis",
    "how vaccines work",
    "the water cycle",
    "compound interest",
    "why the sky is blue",
    "how a computer stores numbers",
    "the causes of the seasons",
    "what a black hole is",
    "how bees make honey",
    "the difference between weather and climate",
    "how the heart pumps blood",
    "why we need sleep",
    "how electricity reaches a house",
    "what inflation is",
    "how a bicycle stays upright",
    "why leaves change colour in autumn",
    "how recycling works",
    "what DNA does",
    "how airplanes fly",
    "the history of the printing press",
)
CODE_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the words in a text",
    "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the order",
    "computes the factorial of a number",
    "finds the largest element of a list",
    "checks whether a string is a palindrome",
    "converts a temperature from Celsius to Fahrenheit",
    "returns the sum of the digits of an integer",
    "sorts a list of dictionaries by a key",
    "reads a file and returns its lines",
    "flattens a nested list",
    "computes the average of a list of numbers",
    "validates an email address with a regular expression",
)
LANGUAGES = ("Python", "JavaScript", "C", "Rust")
PASSAGES = (
    "The town council met on Tuesday to discuss the new park. Residents asked for more benches, a playground "
    "and longer opening hours. The council agreed to build the playground first and to review the budget for "
    "benches next year. The park will open in the summer.",
    "Scientists have found that regular walking improves memory in older adults. In a study of two hundred "
    "people, those who walked for thirty minutes a day scored better on memory tests after six months than "
    "those who did not. The researchers think that exercise increases blood flow to the brain.",
    "The company reported higher sales this quarter, mainly because of strong demand for its new phone. "
    "However, costs also rose because of higher prices for parts. The company expects sales to slow down next "
    "quarter and plans to hire fewer people.",
    "Honey bees communicate the location of flowers through a waggle dance. The direction of the dance shows "
    "the direction of the food relative to the sun, and the length of the dance shows how far away it is. "
    "Other bees watch the dance and then fly to the flowers.",
    "The library will close for two weeks in March for repairs to its roof. During this time, books can be "
    "returned at the community centre. Online services, including e-books and audiobooks, will stay "
    "available. The library thanks visitors for their patience.",
    "A new study suggests that children who read for fun are better at solving problems. The study followed "
    "children for five years and found that reading stories helps them imagine different solutions. Parents "
    "are encouraged to read with their children every day.",
)
CHAT = (
    "What are some good habits for staying healthy?",
    "Can you recommend a few books for someone who likes science fiction?",
    "How do I make a simple tomato soup?",
    "What should I pack for a weekend camping trip?",
    "How can I become better at managing my time?",
    "What are the benefits of learning a second language?",
    "Give me some ideas for a birthday party for a ten year old.",
    "How do I start learning to play the guitar?",
    "What is a good way to prepare for a job interview?",
    "How can I save money on groceries?",
    "What are some fun things to do on a rainy day?",
    "How do I take care of a houseplant?",
    "What is the best way to learn to cook?",
    "Can you help me plan a trip to Italy?",
    "How do I write a good cover letter?",
    "What are some tips for running a first marathon?",
)
FOLLOW_UPS = (
    "Can you tell me more about the first point?",
    "Thanks! Could you make it shorter?",
    "Can you give me an example?",
    "What would you do differently?",
)


def conversations(seed: int = 0) -> list[list[dict[str, str]]]:
    """Every conversation of the set (a list of ``{"role", "content"}`` messages, the last one the user's), in
    an order shuffled by ``seed``.  Multi-turn ones hold a canned first answer (the model answers the last
    turn)."""
    out: list[list[dict[str, str]]] = []

    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    for t in TOPICS:
        out.append(user(f"Write a short story about {t}."))
        out.append(user(f"Write a poem about {t}."))
        out.append(user(f"Describe {t} in a few vivid sentences."))
    for s in SUBJECTS:
        out.append(user(f"Explain {s} in simple terms."))
        out.append(user(f"Explain {s} to a ten year old."))
        out.append(user(f"Write three facts about {s}."))
    for i, task in enumerate(CODE_TASKS):
        for lang in (LANGUAGES[i % len(LANGUAGES)], "Python"):
            out.append(user(f"Write a {lang} function that {task}."))
        out.append(user(f"Write a Python function that {task}, with a docstring and a short test."))
    for p in PASSAGES:
        out.append(user(f"Summarize the following text in two sentences:\n\n{p}"))
        out.append(user(f"What is the main point of this text?\n\n{p}"))
        out.append(user(f"Rewrite this text for a child:\n\n{p}"))
    for i, q in enumerate(CHAT):
        out.append(user(q))
        first = "Here are a few ideas to get you started."
        follow = FOLLOW_UPS[i % len(FOLLOW_UPS)]
        out.append([*user(q), {"role": "assistant", "content": first}, *user(follow)])
    random.Random(seed).shuffle(out)
    return out


def prompt_set_hash(convs: list[list[dict[str, str]]]) -> str:
    """SHA-256 (hex) of the conversations as JSON: which prompts a head was trained on."""
    return hashlib.sha256(json.dumps(convs, sort_keys=True).encode()).hexdigest()


__all__ = ["conversations", "prompt_set_hash"]
