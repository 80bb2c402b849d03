"""The speculative-decoding benchmark's workloads: text that looks like real use, shipped and fixed (standard
library only; no random ids, nothing drawn at run time).

A workload is a list of sessions; a session is a system message (or None) and the user turns of one
conversation.  ``mechserve bench spec-decode`` sends turn ``k`` of a session with the answers to turns
``0 .. k-1`` in the conversation (the chat template renders it), so a later turn's prompt holds the
earlier answers, as a chat client's does::

    chat         4-turn conversations: a question, then follow-ups that rework the answer (shorten it,
                 list it, repeat a part of it)
    agent        an agent loop: one JSON tool schema in the system message, 4 turns each asking for one
                 more call of the same tool with the previous result pasted back
    code-edit    rewrite a given function with one small change
    summarise    summarise a passage of the shipped Declaration of Independence (data/)
    novel        open-ended writing: nothing to copy
    copy         copy-heavy tasks (repeat, spell-fix, rename, reformat; the original prompt-lookup set)

Each workload has 8 sessions (``--prompts`` takes the first N).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

TEXT = Path(__file__).with_name("data") / "declaration-of-independence.txt"


@dataclass(frozen=True, slots=True)
class Session:
    """One conversation: its ``system`` message (None: none) and its user ``turns``, sent one after another."""

    turns: tuple[str, ...]
    system: str | None = None


PASSAGE = (
    "The old lighthouse stood at the end of the pier for more than a hundred years. Every evening the keeper "
    "climbed its narrow stairs, lit the lamp and watched the fishing boats come home before the storm."
)
CODE = (
    "def average(values):\n"
    "    total = 0\n"
    "    for v in values:\n"
    "        total = total + v\n"
    "    return total / len(values)\n"
)
COPY = [
    f"Repeat the following text exactly, word for word.\n\n{PASSAGE}",
    "Fix the spelling mistakes in this text and return the corrected text only.\n\n"
    + PASSAGE.replace("lighthouse", "lighthuose").replace("evening", "evenning").replace("storm", "strom"),
    f"Rename the variable `total` to `acc` in this Python function. Return only the code.\n\n{CODE}",
    f"Add a docstring to this Python function. Return the full function.\n\n{CODE}",
    'Change the city to "Lyon" in this JSON object and return the whole object.\n\n'
    '{"name": "Alice Martin", "age": 34, "city": "Paris", "email": "alice.martin@example.com", '
    '"languages": ["French", "English", "Spanish"]}',
    "Rewrite the following text, replacing the word 'keeper' with 'guardian'.\n\n" + PASSAGE,
    "Put each item of this list on its own line, keeping the order: apples, bananas, cherries, dates, "
    "elderberries, figs, grapes, honeydew melons, kiwis, lemons.",
    f"Copy the second sentence of this text.\n\n{PASSAGE}",
]
NOVEL = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue.",
    "Give three tips for staying productive when working from home.",
    "What are the health benefits of regular exercise?",
    "Describe a sunset over the ocean.",
    "How do airplanes stay in the air?",
    "Suggest a name for a new coffee shop and explain your choice.",
    "What should I pack for a weekend hiking trip?",
]
CHAT_OPENERS = [
    "How do I make a simple tomato sauce for pasta?",
    "What is the difference between a list and a tuple in Python?",
    "Plan a one-day visit to Paris for someone who loves museums.",
    "How does a bicycle gear system work?",
    "Write a polite email asking my landlord to fix the heating.",
    "What are good habits for getting better sleep?",
    "Explain how compound interest works with an example.",
    "How should I prepare for a job interview as a software developer?",
]
CHAT_FOLLOW_UPS = (
    "Thanks. Now give me the same answer as a numbered list of short steps.",
    "Repeat the second step of your list word for word, then explain it in more detail.",
    "Finally, put your whole numbered list again, unchanged, and add one more step at the end.",
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
AGENT_SYSTEM = (
    "You are an assistant that answers only by calling tools. You have one tool:\n"
    f"{json.dumps(TOOL)}\n"
    'Reply with exactly one JSON object {"name": "get_weather", "arguments": {"city": ..., "unit": ...}} '
    "and nothing else."
)
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Oslo", "Prague", "Dublin", "Warsaw", "Athens"]
FUNCTIONS = [
    (
        "def area(width, height):\n    return width * height\n",
        "Add a check that raises ValueError if either is negative.",
    ),
    (
        "def greet(name):\n    message = 'Hello, ' + name\n    print(message)\n    return message\n",
        "Use an f-string instead of string concatenation.",
    ),
    (
        "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
        "        if word in counts:\n            counts[word] += 1\n        else:\n            counts[word] = 1\n"
        "    return counts\n",
        "Make the word counting case-insensitive.",
    ),
    (
        "def fahrenheit(celsius):\n    return celsius * 9 / 5 + 32\n",
        "Round the result to one decimal place.",
    ),
    (
        "def first_even(numbers):\n    for n in numbers:\n        if n % 2 == 0:\n            return n\n"
        "    return None\n",
        "Return -1 instead of None when there is no even number.",
    ),
    (
        "def load_lines(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
        "    return [line.strip() for line in lines]\n",
        "Skip empty lines.",
    ),
    (
        "class Counter:\n    def __init__(self):\n        self.value = 0\n\n    def increment(self):\n"
        "        self.value += 1\n        return self.value\n",
        "Add a reset method that sets the value back to 0.",
    ),
    (
        "def maximum(values):\n    best = values[0]\n    for v in values[1:]:\n        if v > best:\n"
        "            best = v\n    return best\n",
        "Raise ValueError with a clear message when values is empty.",
    ),
]


def passages(count: int = 8) -> list[str]:
    """``count`` consecutive passages of the shipped text, of about even lengths (its sentences, in order)."""
    text = " ".join(TEXT.read_text(encoding="utf-8").split())
    sentences = re.split(r"(?<=[.;:])\s+", text)
    total = sum(len(x) for x in sentences)
    groups: list[list[str]] = [[] for _ in range(count)]
    done = 0
    for sentence in sentences:
        groups[min(count - 1, done * count // total)].append(sentence)
        done += len(sentence)
    return [" ".join(g) for g in groups]


def agent_session(i: int) -> Session:
    """Session ``i`` of the agent loop: four calls of the same tool, the previous result pasted back."""
    turns = [f"What is the weather in {CITIES[i]}? Use celsius."]
    for k in range(1, 4):
        city, before = CITIES[(i + k) % len(CITIES)], CITIES[(i + k - 1) % len(CITIES)]
        result = {"city": before, "temperature": 10 + (3 * i + 5 * k) % 17, "unit": "celsius", "sky": "cloudy"}
        turns.append(f"Tool result: {json.dumps(result)}\nNow get the weather in {city}, in celsius.")
    return Session(tuple(turns), AGENT_SYSTEM)


def workloads() -> dict[str, list[Session]]:
    """Every workload by name (module docstring), 8 sessions each."""
    return {
        "chat": [Session((opener, *CHAT_FOLLOW_UPS)) for opener in CHAT_OPENERS],
        "agent": [agent_session(i) for i in range(8)],
        "code-edit": [
            Session((f"Rewrite this function with one change: {change} Return only the code.\n\n{code}",))
            for code, change in FUNCTIONS
        ],
        "summarise": [Session((f"Summarise the following text in three sentences.\n\n{p}",)) for p in passages()],
        "novel": [Session((p,)) for p in NOVEL],
        "copy": [Session((p,)) for p in COPY],
    }


WORKLOADS = tuple(workloads())

__all__ = ["WORKLOADS", "Session", "passages", "workloads"]
