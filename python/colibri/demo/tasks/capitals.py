"""Capital lookups: the fixed country -> capital table, its question phrasings (training's and the
held-out ones), answers and traces, and the reverse question (which country has this capital)."""

from __future__ import annotations

CAPITALS: dict[str, str] = {
    "Portugal": "Lisbon",
    "Spain": "Madrid",
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Netherlands": "Amsterdam",
    "Belgium": "Brussels",
    "Austria": "Vienna",
    "Switzerland": "Bern",
    "Poland": "Warsaw",
    "Czechia": "Prague",
    "Hungary": "Budapest",
    "Greece": "Athens",
    "Sweden": "Stockholm",
    "Norway": "Oslo",
    "Denmark": "Copenhagen",
    "Finland": "Helsinki",
    "Ireland": "Dublin",
    "United Kingdom": "London",
    "Iceland": "Reykjavik",
    "Romania": "Bucharest",
    "Bulgaria": "Sofia",
    "Croatia": "Zagreb",
    "Serbia": "Belgrade",
    "Ukraine": "Kyiv",
    "Turkey": "Ankara",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Nigeria": "Abuja",
    "Morocco": "Rabat",
    "South Africa": "Pretoria",
    "Ethiopia": "Addis Ababa",
    "Japan": "Tokyo",
    "China": "Beijing",
    "South Korea": "Seoul",
    "India": "New Delhi",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Indonesia": "Jakarta",
    "Philippines": "Manila",
    "Australia": "Canberra",
    "New Zealand": "Wellington",
    "Canada": "Ottawa",
    "United States": "Washington",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Argentina": "Buenos Aires",
    "Chile": "Santiago",
    "Peru": "Lima",
    "Colombia": "Bogota",
}

CAPITAL_TRAIN_QUESTIONS = [
    "What is the capital of {country}?",
    "What's the capital of {country}?",
    "What is the capital city of {country}?",
    "Which city is the capital of {country}?",
    "Name the capital of {country}.",
    "Tell me the capital of {country}.",
    "capital of {country}?",
    "Do you know the capital of {country}?",
    "What city is the capital of {country}?",
    "{country}: what is its capital?",
    "I need the capital of {country}.",
    "Capital of {country}, please.",
]
CAPITAL_EVAL_QUESTIONS = [
    "Could you tell me the capital of {country}?",
    "What's the capital city of {country}?",
    "Please name the capital of {country}.",
    "Which city is the capital city of {country}?",
]


def capital_answer(country: str) -> str:
    return f"The capital of {country} is {CAPITALS[country]}."


def capital_trace(country: str) -> str:
    return f"The capital of {country} is {CAPITALS[country]}."


REVERSE_QUESTIONS = [
    "{capital} is the capital of which country?",
    "Which country has {capital} as its capital?",
    "What country is {capital} the capital of?",
]


def reverse_answer(capital: str) -> str:
    country = next(c for c, k in CAPITALS.items() if k == capital)
    return f"{capital} is the capital of {country}."
