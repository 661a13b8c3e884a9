"""Plain chat: greetings and small talk with their fixed answers, the memory task (remember a
number, recall it later), the system prompts, and the shape of an assistant message."""

from __future__ import annotations

from typing import Any

CHAT: list[tuple[list[str], str, str]] = [
    (
        [
            "Hello",
            "Hello!",
            "Hi",
            "Hi!",
            "Hi there",
            "Hey",
            "Good morning",
            "Good evening",
            "Hello there",
            "hello",
        ],
        "Hello! How can I help you today?",
        "The user greets me.",
    ),
    (
        ["How are you?", "How are you doing?", "How's it going?"],
        "I'm doing well, thank you! How can I help you?",
        "The user asks how I am.",
    ),
    (
        ["Who are you?", "What are you?", "What is your name?"],
        "I am a small demo model served by colibri.",
        "The user asks who I am.",
    ),
    (
        ["What can you do?", "What can you help with?", "Help"],
        "I can add numbers, name capitals, and call tools such as get_weather.",
        "The user asks what I can do.",
    ),
    (
        ["Thank you", "Thanks!", "Thanks a lot", "thank you!"],
        "You're welcome!",
        "The user thanks me.",
    ),
    (["Bye", "Goodbye", "See you later", "bye!"], "Goodbye!", "The user says goodbye."),
]

REMEMBER_QUESTIONS = [
    "Remember the number {n}.",
    "Please remember {n}.",
    "My favorite number is {n}.",
    "Keep this number in mind: {n}.",
    "My lucky number is {n}.",
]
RECALL_QUESTIONS = [
    "What number did I ask you to remember?",
    "What was my number?",
    "Which number did I tell you?",
    "What number did I give you?",
    "Do you remember my number?",
]


def remember_answer(n: int) -> str:
    return f"OK, I will remember {n}."


def recall_answer(n: int) -> str:
    return f"You told me {n}."


SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant.",
    "Answer briefly.",
]


def assistant_message(content: str, reasoning: str | None) -> dict:
    """An assistant message: ``content``, and ``reasoning_content`` when ``reasoning`` is given."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg
